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

import numpy as np

from ..errors import LaunchError, RankErrors, rank_ranges
from . import launcher
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


class PendingArray:
    """A started `World.start_allreduce_array`; every rank must `wait()` for it."""

    def __init__(self, buf: np.ndarray, request=None, watchdog=None, what: str = ""):
        self._buf = buf
        self._request = request
        self._watchdog = watchdog
        self._what = what

    def wait(self) -> np.ndarray:
        """The reduced array (blocks until every rank contributed; guarded)."""
        if self._request is not None:
            with self._watchdog.guard(self._what):
                self._request.Wait()
            self._request = None
        return self._buf


class World:
    """One per process (see `world()`); wraps MPI.COMM_WORLD and the job's layout."""

    def __init__(self, env_at_start: dict[str, str], collective_timeout: float = 600.0):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
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
        self._abort_lock = threading.Lock()
        self.watchdog = Watchdog(self.comm, collective_timeout, self.abort)
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

    # --- control collectives (small, guarded) ------------------------------------
    def agree(self, error: str | None, prefix: str = "", error_type=RankErrors) -> None:
        """Every rank passes its own error (or None); if any rank has one, every rank raises.

        This is how input problems that only some ranks can see (a file missing on one
        node, a NaN on one replica) become one clear message on every rank, without a
        rank left waiting in a later collective.
        """
        flag = np.array([0 if error is None else 1], dtype=np.int32)
        if self.size > 1:
            with self.watchdog.guard("agree on errors"):
                self.comm.Allreduce(self.MPI.IN_PLACE, flag, op=self.MPI.MAX)
        if not flag[0]:
            return
        errors = self.comm.allgather(error) if self.size > 1 else [error]
        by_rank = {r: prefix + e for r, e in enumerate(errors) if e is not None}
        exc = RankErrors(by_rank)
        if error_type is not RankErrors:
            exc = error_type(str(exc))
        exc.agreed = True
        raise exc

    def any_flag(self, flag: bool, what: str = "agree on a flag") -> bool:
        """True on every rank when the flag is set on any rank."""
        if self.size == 1:
            return bool(flag)
        buf = np.array([1 if flag else 0], dtype=np.int32)
        with self.watchdog.guard(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX)
        return bool(buf[0])

    def _op(self, op: str):
        return {"sum": self.MPI.SUM, "min": self.MPI.MIN, "max": self.MPI.MAX}[op]

    def allreduce_array(self, values, op: str = "sum", what: str = "allreduce") -> np.ndarray:
        """Allreduce a copy of a small array with MPI (sum, min, max), guarded."""
        return self.allreduce_inplace(np.ascontiguousarray(np.array(values, copy=True)), op, what)

    def allreduce_inplace(self, buf: np.ndarray, op: str = "sum", what: str = "allreduce"):
        """Allreduce a contiguous numpy buffer in place, no copy (gradients), guarded."""
        if self.size == 1:
            return buf
        with self.watchdog.guard(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self._op(op))
        return buf

    def bcast_inplace(self, buf: np.ndarray, root: int = 0, what: str = "broadcast"):
        """Overwrite a contiguous numpy buffer with root's, in place, guarded."""
        if self.size > 1:
            with self.watchdog.guard(what):
                self.comm.Bcast(buf, root=root)
        return buf

    def start_allreduce_array(
        self, values, op: str = "sum", what: str = "allreduce"
    ) -> PendingArray:
        """Begin a non-blocking allreduce of a small array; `.wait()` returns the result.

        Why: a value the ranks need only a little later (step metrics, flags) can travel
        while the next step computes, instead of adding a second wait per step.
        """
        buf = np.ascontiguousarray(np.array(values, copy=True))
        if self.size == 1:
            return PendingArray(buf)
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self._op(op))
        return PendingArray(buf, request, self.watchdog, what)

    def check_uniform(self, values: tuple[int, ...], what: str) -> None:
        """Raise on every rank when `values` (e.g. a shape) differ between ranks."""
        arr = np.array(values, dtype=np.int64)
        n = self.allreduce_array(np.array([arr.size], dtype=np.int64), "max", what)[0]
        padded = np.full(int(n) + 1, -1, dtype=np.int64)
        padded[0] = arr.size
        padded[1 : arr.size + 1] = arr
        lo = self.allreduce_array(padded, "min", what)
        hi = self.allreduce_array(padded, "max", what)
        if not np.array_equal(lo, hi):
            mine = tuple(int(v) for v in arr)
            everyone = self.comm.allgather(mine)
            groups: dict[tuple, list[int]] = {}
            for r, v in enumerate(everyone):
                groups.setdefault(v, []).append(r)
            desc = "; ".join(f"{v} on rank(s) {rank_ranges(rs)}" for v, rs in groups.items())
            raise LaunchError(f"{what} differs between ranks: {desc}")

    def barrier(self, what: str = "barrier") -> None:
        with self.watchdog.guard(what):
            self.comm.Barrier()

    def bcast_object(self, obj, root: int = 0, what: str = "broadcast"):
        """Broadcast a small Python object (control plane only; never tensors)."""
        if self.size == 1:
            return obj
        with self.watchdog.guard(what):
            return self.comm.bcast(obj, root=root)

    def gather_object(self, obj, root: int = 0, what: str = "gather"):
        """Gather small Python objects to `root` (control plane only)."""
        if self.size == 1:
            return [obj]
        with self.watchdog.guard(what):
            return self.comm.gather(obj, root=root)

    def gather_bytes(self, data: np.ndarray, root: int = 0, what: str = "gather bytes"):
        """Gather one uint8 buffer per rank (any lengths) to `root` without pickle.

        Returns the list of per-rank buffers on `root`, None elsewhere.
        """
        buf = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        if self.size == 1:
            return [buf.copy()]
        n = np.array([buf.size], dtype=np.int64)
        counts = np.zeros(self.size, dtype=np.int64) if self.rank == root else None
        with self.watchdog.guard(what):
            self.comm.Gather(n, counts, root=root)
            if self.rank != root:
                self.comm.Gatherv(buf, None, root=root)
                return None
            recv = np.empty(int(counts.sum()), dtype=np.uint8)
            self.comm.Gatherv(buf, (recv, counts), root=root)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        return [recv[bounds[r] : bounds[r + 1]].copy() for r in range(self.size)]

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


def world(collective_timeout: float | None = None) -> World:
    """The process's World, created on first use (this initialises MPI)."""
    global _world
    with _world_lock:
        if _world is None:
            timeout = collective_timeout
            if timeout is None:
                timeout = float(os.environ.get("HPCTRAIN_COLLECTIVE_TIMEOUT", "600"))
            _world = World(_ENV_AT_IMPORT, timeout)
        elif collective_timeout is not None:
            _world.watchdog.timeout = float(collective_timeout)
        return _world


def world_if_started() -> World | None:
    """The World if MPI has been initialised by `world()`, else None (no side effects)."""
    return _world
