"""A communicator whose every collective runs under a deadline (the watchdog).

The World (all ranks) and every axis of the process grid (`grid.py`) are one of these,
so code written against this interface runs unchanged on the whole job or on one axis:
`axis.allreduce_inplace(buf)` is the same call as `world.allreduce_inplace(buf)`.
Every collective here is small control traffic or an in-place buffer reduction; each
is guarded, so a rank that never arrives ends the job with its rank named.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..errors import LaunchError, RankErrors, rank_ranges
from . import p2p
from .host_arrays import HostArrays

_INLINE_BYTES = 1 << 16  # gather_arrays: smaller values travel with the names
_ARRAYS_TAG = 7301  # gather_arrays' messages (in order per sender: MPI does not overtake)


def _offsets(counts) -> list[int]:
    """Where each rank's piece starts in a buffer of pieces of `counts` (the v forms)."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()


def under_deadline(comm, what: str):
    """A section of `comm`'s watchdog around a host wait that is not one of its calls:
    a GPU rank waiting for device work that its process-group collectives are part of
    (NCCL's waits block no host thread, so a stalled peer shows only there). Named at
    runtime.collective_timeout, as in an MPI collective; no section where `comm` has no
    watchdog (one rank, a test's stand-in)."""
    watchdog = getattr(comm, "watchdog", None)
    return watchdog.guard(what) if watchdog is not None else contextlib.nullcontext()


class PendingArray:
    """A started collective or point-to-point operation (the exchange layer's `Pending`);
    every rank must `wait()` for it. `peer` (point-to-point: (communicator, who)) waits
    by polling with the communicator's deadline, naming the peer, instead of the
    watchdog, which guards sections that every rank enters."""

    def __init__(self, buf: np.ndarray, request=None, watchdog=None, what: str = "", peer=None):
        self._buf = buf
        self._request = request
        self._watchdog = watchdog
        self._what = what
        self._peer = peer

    def test(self) -> bool:
        """Progress the operation without blocking; True once it completed.

        Open MPI moves a non-blocking collective only inside MPI calls (measured: an
        Iallreduce left alone for 200 ms had not advanced), so whoever waits calls this."""
        if self._request is not None and self._request.Test():
            self._request = None
        return self._request is None

    def wait(self) -> np.ndarray:
        """The reduced array (blocks until every rank contributed; guarded)."""
        if self._request is not None:
            if self._peer is not None:
                p2p.wait_or_abort(self._peer[0], [self._request], self._what, self._peer[1])
            else:
                with self._watchdog.guard(self._what):
                    self._request.Wait()
            self._request = None
        return self._buf


class GuardedComm(HostArrays):
    """Collectives over `comm`, each under `watchdog`'s deadline.

    Subclasses set `MPI`, `comm`, `rank`, `size` and `watchdog`; `GuardedComm.over()`
    builds one for a sub-communicator. It is the MPI implementation of the exchange
    layer's `Transport` (host numpy buffers; exchange/transport.py).
    """

    MPI = None
    comm = None
    rank = 0
    size = 1
    watchdog = None
    name = "world"

    @classmethod
    def over(cls, name: str, comm, watchdog, mpi, abort) -> GuardedComm:
        """A guarded view of `comm` (a grid axis) with its own watchdog; `abort(msg)`
        ends the whole job."""
        g = cls.__new__(cls)
        g.name, g.comm, g.watchdog, g.MPI, g.abort = name, comm, watchdog, mpi, abort
        g.rank, g.size = comm.Get_rank(), comm.Get_size()
        return g

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    _node_split = None

    def node_split(self) -> GuardedComm:
        """This communicator's ranks on this node, under the same watchdog (split once,
        then cached): where a shared-memory window lives (node_shared.py)."""
        if self._node_split is None:
            with self.watchdog.guard(f"split '{self.name}' by node"):
                comm = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            self._node_split = GuardedComm.over(
                f"{self.name} on this node", comm, self.watchdog, self.MPI, self.abort
            )
        return self._node_split

    # --- control collectives (small, guarded) ------------------------------------
    def agree(
        self,
        error: str | None,
        prefix: str = "",
        error_type=RankErrors,
        timeout: float | None = None,
        what: str = "agree on errors",
        merge_figures: bool = False,
    ) -> None:
        """Every rank passes its own error (or None); if any rank has one, every rank raises.

        This is how input problems that only some ranks can see (a file missing on one
        node, a NaN on one replica) become one clear message on every rank, without a
        rank left waiting in a later collective. `timeout`: this wait's deadline instead
        of the collective timeout (after a rank's longer work, such as a file write),
        then named with the option that sets it in `what`. `merge_figures`: messages
        that differ in their numbers only are one line (RankErrors).
        """
        flag = np.array([0 if error is None else 1], dtype=np.int32)
        if self.size > 1:
            with self.watchdog.guard(what, timeout):
                self.comm.Allreduce(self.MPI.IN_PLACE, flag, op=self.MPI.MAX)
        if not flag[0]:
            return
        errors = self.comm.allgather(error) if self.size > 1 else [error]
        by_rank = {r: prefix + e for r, e in enumerate(errors) if e is not None}
        exc = RankErrors(by_rank, merge_figures, alone=self.size == 1)  # "rank(s) 0:" says nothing
        if error_type is not RankErrors:
            exc = error_type(str(exc))
        exc.agreed = True
        exc.rank, exc.size = self.rank, self.size  # for printing it once (failfast)
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

    def start_allreduce_inplace(
        self, buf: np.ndarray, op: str = "sum", what: str = "allreduce"
    ) -> PendingArray:
        """Begin a non-blocking allreduce of a contiguous buffer in place (no copy): a
        gradient bucket travels while backward goes on. Every rank must start the same
        buffers in the same order, then `.wait()` for each (guarded)."""
        if self.size == 1:
            return PendingArray(buf)
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self._op(op))
        return PendingArray(buf, request, self.watchdog, what)

    def reduce_scatter_sum(self, buf: np.ndarray, counts: list[int], what: str) -> np.ndarray:
        """Sum `buf` over the ranks and keep this rank's slice (counts[rank] elements, in
        rank order), guarded. Per rank (N-1)/N of the buffer travels, whatever N."""
        mine = np.empty(int(counts[self.rank]), dtype=buf.dtype)
        if self.size == 1:
            mine[:] = buf
            return mine
        with self.watchdog.guard(what):
            self.comm.Reduce_scatter(buf, mine, recvcounts=list(counts), op=self.MPI.SUM)
        return mine

    def allgather_into(self, mine: np.ndarray, buf: np.ndarray, counts: list[int], what: str):
        """Every rank's slice (counts[r] elements, in rank order) into `buf`, guarded."""
        if self.size == 1:
            buf[:] = mine
            return buf
        with self.watchdog.guard(what):
            if len(set(counts)) == 1:  # equal pieces (ZeRO's, the compressors'): the
                # plain collective, whose algorithms Open MPI tunes more than the v form
                self.comm.Allgather(mine, buf[: counts[0] * self.size])
            else:
                displs = _offsets(counts)
                self.comm.Allgatherv(mine, [buf, (list(counts), displs)])
        return buf

    def start_allgather_into(
        self, mine: np.ndarray, buf: np.ndarray, counts: list[int], what: str
    ) -> PendingArray:
        """Begin `allgather_into` without blocking (`MPI_Iallgatherv`): ZeRO-3 gathers
        the next unit's parameters while this one computes. `mine` and `buf` must stay
        untouched until `.wait()` (guarded); every rank starts the same gathers in the
        same order."""
        if self.size == 1:
            buf[:] = mine
            return PendingArray(buf)
        if len(set(counts)) == 1:
            request = self.comm.Iallgather(mine, buf[: counts[0] * self.size])
        else:
            displs = _offsets(counts)
            request = self.comm.Iallgatherv(mine, [buf, (list(counts), displs)])
        return PendingArray(buf, request, self.watchdog, what)

    def all_to_all(self, send: np.ndarray, recv: np.ndarray, what: str = "all-to-all"):
        """Equal splits: slice r of `send` to rank r, slice r of `recv` from rank r
        (`MPI_Alltoall`), guarded. N-1 messages of len/N per rank: for small groups."""
        if self.size == 1:
            recv[:] = send
            return recv
        with self.watchdog.guard(what):
            self.comm.Alltoall(send, recv)
        return recv

    def all_to_all_v(self, send, recv, send_counts: list, recv_counts: list, what: str):
        """Uneven splits (`MPI_Alltoallv`, counts in elements per rank), guarded."""
        if self.size == 1:
            recv[: int(send_counts[0])] = send[: int(send_counts[0])]
            return recv
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        sd = _offsets(sc)
        rd = _offsets(rc)
        with self.watchdog.guard(what):
            self.comm.Alltoallv([send, (sc, sd)], [recv, (rc, rd)])
        return recv

    def start_all_to_all(
        self, send: np.ndarray, recv: np.ndarray, what: str = "all-to-all"
    ) -> PendingArray:
        """Begin `all_to_all` without blocking (`MPI_Ialltoall`); `.wait()` is guarded."""
        if self.size == 1:
            recv[:] = send
            return PendingArray(recv)
        return PendingArray(recv, self.comm.Ialltoall(send, recv), self.watchdog, what)

    def start_send(
        self, buf: np.ndarray, peer: int, tag: int = 0, what: str = "send", peer_name: str = ""
    ):
        """Begin sending `buf` to `peer`; `.wait()` polls with the collective timeout and
        ends the job naming the peer (`peer_name`, or its rank here) if it never receives."""
        request = self.comm.Isend(buf, dest=peer, tag=tag)
        who = peer_name or f"rank {peer} of {self.name}"
        return PendingArray(buf, request, None, what, (self, who))

    def start_recv(
        self, buf: np.ndarray, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""
    ):
        """Begin receiving `peer`'s message into `buf` (deadline as `start_send`)."""
        request = self.comm.Irecv(buf, source=peer, tag=tag)
        who = peer_name or f"rank {peer} of {self.name}"
        return PendingArray(buf, request, None, what, (self, who))

    def send(
        self, buf: np.ndarray, peer: int, tag: int = 0, what: str = "send", peer_name: str = ""
    ) -> None:
        self.start_send(buf, peer, tag, what, peer_name).wait()

    def recv(
        self, buf: np.ndarray, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""
    ):
        return self.start_recv(buf, peer, tag, what, peer_name).wait()

    def allgather_array(self, send: np.ndarray, what: str = "allgather") -> np.ndarray:
        """Every rank's equally sized array, stacked in rank order (guarded). Each rank
        receives (N-1) x its own bytes: at 1,024 or 4,096 ranks that is 1,023 or 4,095
        times the message, so only small or very sparse payloads belong here."""
        send = np.ascontiguousarray(send)
        if self.size == 1:
            return send[None].copy()
        recv = np.empty((self.size, *send.shape), dtype=send.dtype)
        with self.watchdog.guard(what):
            self.comm.Allgather(send, recv)
        return recv

    def gather_array(self, send: np.ndarray, root: int = 0, what: str = "gather"):
        """Every rank's equally sized array stacked in rank order on `root` (None on the
        others), guarded. Root receives N x the message (the whole of a sharded state:
        at 1,024 or 4,096 ranks that is still one copy of it), the others send once."""
        send = np.ascontiguousarray(send)
        if self.size == 1:
            return send[None].copy()
        recv = np.empty((self.size, *send.shape), dtype=send.dtype) if self.rank == root else None
        with self.watchdog.guard(what):
            self.comm.Gather(send, recv, root=root)
        return recv

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

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        """Every rank waits for the others; `timeout`: this wait's deadline instead of the
        collective timeout (where a rank is known to be busy longer, writing a file)."""
        if self.size == 1:
            return
        with self.watchdog.guard(what, timeout):
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

    def allgather_object(self, obj, what: str = "allgather") -> list:
        """Every rank's small Python object on every rank (control plane only, rare:
        an error report). Cost O(N) objects per rank: 4,096 flags is a few kB."""
        if self.size == 1:
            return [obj]
        with self.watchdog.guard(what):
            return self.comm.allgather(obj)

    def gather_arrays(self, arrays: dict | None, root: int = 0, what: str = "gather arrays"):
        """Every rank's {name: value} (or None) on `root` in rank order, None elsewhere.

        For a checkpoint's state: the names, shapes and small values travel as one small
        object per rank; each large array's bytes go by guarded point-to-point messages
        straight into an array `root` allocates (a pickled gather held each array three
        times on `root` at once: the sender's pickle, the receive buffer and the arrays
        unpickled from it, and its arrays did not own their memory). `root` keeps its own
        dict as given. Cost: `root` receives every other rank's state once, in one
        message per large array; used over a tensor group, an expert group or a
        pipeline's replica 0, whose sizes do not grow with the data-parallel ranks."""
        if self.size == 1:
            return [arrays]
        meta, large = None, []
        if arrays is not None:
            meta = {}
            for k, v in arrays.items():
                if isinstance(v, np.ndarray) and v.nbytes >= _INLINE_BYTES:
                    meta[k] = (True, (v.shape, v.dtype.str))
                    large.append(np.ascontiguousarray(v))
                else:
                    meta[k] = (False, v)  # a step count, a small slot: with the names
        metas = self.gather_object(meta, root, what=f"{what} (names)")
        if self.rank != root:
            for pending in [self.start_send(a, root, _ARRAYS_TAG, what) for a in large]:
                pending.wait()
            return None
        out, pending = [], []
        for r, m in enumerate(metas):
            if r == root or m is None:
                out.append(arrays if r == root else None)
                continue
            got = {}
            for k, (sent, entry) in m.items():
                if sent:
                    got[k] = np.empty(entry[0], np.dtype(entry[1]))
                    pending.append(self.start_recv(got[k], r, _ARRAYS_TAG, what))
                else:
                    got[k] = entry
            out.append(got)
        for p in pending:
            p.wait()
        return out

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
