"""An emulated multi-node cluster on one machine, for tests and benchmarks (needs root).

Each node is a network namespace with its own hostname and address, joined to one
bridge by a veth link that `tc` can shape to 1, 10 or 25 Gbit/s; Open MPI starts its
daemons inside the nodes through an rsh agent, so `mpirun` spans them as it spans real
hosts. `hpctrain cluster up|down|status|link|mpirun-args|run` (cli.py) drives it by
hand; `session()` holds it for a test run or a benchmark and always tears it down.

A tool, not part of training: it imports nothing of hpctrain but its errors.
"""

from .errors import ClusterError, ClusterUnavailable
from .netns import STATE_DIR, down, read_state, status, up
from .plan import (
    DEFAULT_BRIDGE,
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    NAMED_LINKS,
    Plan,
    link_rate,
    mpirun_args,
)
from .session import Cluster, Lock, session

__all__ = [
    "DEFAULT_BRIDGE",
    "DEFAULT_PREFIX",
    "DEFAULT_SUBNET",
    "NAMED_LINKS",
    "STATE_DIR",
    "Cluster",
    "ClusterError",
    "ClusterUnavailable",
    "Lock",
    "Plan",
    "down",
    "link_rate",
    "mpirun_args",
    "read_state",
    "session",
    "status",
    "up",
]
