"""The World: this process's place in the MPI job, created once, used by everything.

All MPI plumbing of hpctrain lives in this package (hpctrain.runtime): rank layout,
role sub-communicators, fail-together, the collective watchdog and the small control
collectives (agreement on errors, flags and scalars) the rest of the suite needs.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import LaunchError
from . import launcher
from .comm import GuardedComm
from .openmpi import OpenMpiDefaults
from .watchdog import Watchdog


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: global, within its node, and which node."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    nodes: int
    hostname: str
    launcher: str

    def as_dict(self) -> dict:
        return asdict(self)


class World(GuardedComm):
    """One per process (see `world()`); wraps MPI.COMM_WORLD and the job's layout."""

    def __init__(
        self,
        env_at_start: dict[str, str],
        collective_timeout: float = 600.0,
        stall_warning: float = 60.0,
    ):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        # The watchdog's monitor (and the parameter server's heartbeat) call MPI from a
        # second thread: anything below THREAD_MULTIPLE would corrupt MPI state silently.
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            names = {
                MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
            }
            raise LaunchError(
                f"MPI provides {names.get(provided, provided)}, but hpctrain calls MPI from "
                "a second thread (the collective watchdog, parameter-server heartbeats) and "
                "needs MPI_THREAD_MULTIPLE: use an MPI built with thread support and leave "
                "mpi4py's thread level at its default (unset MPI4PY_RC_THREAD_LEVEL)"
            )
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        leaders = np.zeros(self.size, dtype=np.int64)
        # The leader of a node is its lowest world rank; a node's index is its leader's
        # position among all leaders, so node indices follow rank order.
        my_leader = np.array([self.rank], dtype=np.int64)
        self._local.Bcast(my_leader, root=0)
        self.comm.Allgather(my_leader, leaders)
        node_leaders = sorted(set(int(x) for x in leaders))
        views = launcher.launcher_views(env_at_start)
        self.layout = Layout(
            rank=self.rank,
            size=self.size,
            local_rank=self._local.Get_rank(),
            local_size=self._local.Get_size(),
            node=node_leaders.index(int(my_leader[0])),
            nodes=len(node_leaders),
            hostname=socket.gethostname(),
            launcher=launcher.launcher_name(views),
        )
        self._subcomms: dict[str, object] = {}
        self._guarded: dict[str, GuardedComm] = {}
        self._abort_lock = threading.Lock()
        self.watchdog = Watchdog(
            self.comm, float(collective_timeout), self.abort, float(stall_warning)
        )
        self._watchdogs = [self.watchdog]
        problems = launcher.disagreements(self.layout.as_dict(), views)
        launched_size = max((v.values.get("size", 1) for v in views), default=1)
        if self.size == 1 and launched_size > 1:
            problems.insert(
                0,
                f"the launcher started {launched_size} processes but each one is "
                "a separate MPI job of size 1 (e.g. `horovodrun --gloo`, or an "
                "MPI library other than the one mpi4py was built with); hpctrain "
                "needs an MPI launch: mpirun, srun --mpi=pmix, or horovodrun "
                "without --gloo",
            )
        self.agree(
            "; ".join(problems) if problems else None,
            prefix="launcher variables disagree with MPI: ",
            error_type=LaunchError,
        )

    # --- layout shortcuts ----------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self.layout.local_rank

    @property
    def local_size(self) -> int:
        return self.layout.local_size

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # --- sub-communicators -------------------------------------------------------
    def guarded_split(self, name: str, color: int, key: int | None = None) -> GuardedComm:
        """A sub-communicator with its own watchdog; collective the first time. Cached by
        `name` for the process, so the name must fix every rank's color and key (the
        grid names its axes by shape): a later run in the same process with another
        partition under the same name would get the old groups."""
        if name not in self._guarded:
            self._guarded[name] = self._guard(name, self.split(name, color, key))
        return self._guarded[name]

    def _guard(self, name: str, comm) -> GuardedComm:
        watchdog = Watchdog(comm, self.watchdog.timeout, self.abort, self.watchdog.stall_warning)
        watchdog.report_dir = self.watchdog.report_dir
        watchdog.starting = self.watchdog.starting
        watchdog.says_pauses = False
        watchdog.startup_timeout = self.watchdog.startup_timeout
        self._watchdogs.append(watchdog)
        return GuardedComm.over(name, comm, watchdog, self.MPI, self.abort)

    @property
    def node(self) -> GuardedComm:
        """The ranks of this node, in world-rank order, with their own watchdog: a guarded
        view of the node communicator made at start-up (no further split)."""
        if "node" not in self._guarded:
            self._guarded["node"] = self._guard("node", self._local)
        return self._guarded["node"]

    def node_split(self) -> GuardedComm:
        """The world's ranks on this node: the node communicator made at start-up."""
        return self.node

    def split(self, name: str, color: int, key: int | None = None):
        """A sub-communicator by role (cached by `name`); collective over the world."""
        if name not in self._subcomms:
            with self.watchdog.guard(f"split communicator '{name}'"):
                self._subcomms[name] = self.comm.Split(color, self.rank if key is None else key)
        return self._subcomms[name]

    @property
    def node_comm(self):
        """Ranks that share this node's memory."""
        return self._local

    # --- stall reports -------------------------------------------------------------
    def set_report_dir(self, path) -> None:
        """Where a watchdog deadline writes its stall report (the loop's run directory)."""
        for w in self._watchdogs:
            w.report_dir = Path(path)

    def set_stall_warning(self, seconds: float) -> None:
        """Warn (once per section) after `seconds` of waiting; 0 turns the warning off."""
        for w in self._watchdogs:
            w.stall_warning = float(seconds)

    def begin_startup(self, seconds: float) -> None:
        """A run starts: until its first step (`end_startup`) waits may take `seconds`
        (imports, building, reading data and checkpoints, at each rank's own pace) when
        that is longer than the collective timeout; a stopped rank is still named at
        every collective timeout (the watchdog's liveness check)."""
        for w in self._watchdogs:
            w.starting, w.startup_timeout = True, float(seconds)

    def end_startup(self) -> None:
        """From now on (this rank's first step has run) every wait has the collective
        timeout. Rank-local and idempotent: a rank ahead by a step waits at most a step."""
        for w in self._watchdogs:
            w.starting = False

    # --- ending the job ------------------------------------------------------------
    def abort(self, message: str, code: int = 1):
        """Print `message` once from this rank and end every rank of the job now."""
        with self._abort_lock:
            sys.stdout.flush()
            sys.stderr.write(f"[rank {self.rank}/{self.size}] FATAL: {message}\n")
            sys.stderr.flush()
            self.comm.Abort(code)
            os._exit(code)  # Abort does not return; belt and braces


_world: World | None = None
_world_lock = threading.Lock()
_ENV_AT_IMPORT = dict(os.environ)


def world(
    collective_timeout: float | None = None,
    stall_warning: float | None = None,
    openmpi: OpenMpiDefaults | None = None,
    startup_timeout: float | None = None,
) -> World:
    """The process's World, created on first use (this initialises MPI).

    collective_timeout, stall_warning: the watchdog's deadline and warning
    (`runtime.collective_timeout`, `runtime.stall_warning`; 600 s and 60 s when None on
    first use); given again later, they replace the running values. startup_timeout
    (`runtime.startup_timeout`): a run starts, its waits' deadline until its first step
    (`begin_startup`). openmpi: Open MPI defaults to put in the environment before MPI
    starts (first use only; openmpi.py).
    """
    global _world
    with _world_lock:
        if _world is None:
            if openmpi is not None:
                openmpi.apply()
            _world = World(
                _ENV_AT_IMPORT,
                600.0 if collective_timeout is None else collective_timeout,
                60.0 if stall_warning is None else stall_warning,
            )
        else:
            if collective_timeout is not None:
                _world.watchdog.timeout = float(collective_timeout)
            if stall_warning is not None:
                _world.set_stall_warning(stall_warning)
        if startup_timeout is not None:
            _world.begin_startup(startup_timeout)
        return _world


def world_if_started() -> World | None:
    """The World if MPI has been initialised by `world()`, else None (no side effects)."""
    return _world
