"""hpctrain's runtime layer: the only place that talks to MPI directly.

Import this package before anything that initialises MPI (it records the launcher's
environment first, so that values MPI_Init may add are not mistaken for the launcher's).
"""

from .failfast import EXIT_USER_ERROR, run_fail_together
from .faults import Faults
from .logs import setup_logging
from .threads import limit_blas_threads, threads_per_rank
from .world import Layout, World, world, world_if_started

__all__ = [
    "EXIT_USER_ERROR",
    "Faults",
    "Layout",
    "World",
    "run_fail_together",
    "setup_logging",
    "limit_blas_threads",
    "threads_per_rank",
    "world",
    "world_if_started",
]
