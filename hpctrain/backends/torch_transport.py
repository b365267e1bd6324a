"""The exchange layer's transport (exchange/transport.py) over torch tensors on a
torch.distributed process group: Gloo on CPU ranks, NCCL on GPU ranks, the same code.

The buffers stay on the rank's device: ZeRO's gradient pieces, shard and parameter
gathers never cross to the host. The group is the process-group engine's
(`torch_pg.init_process_group`, bootstrapped over MPI).

Deadlines: every call is issued with `async_op=True` and waited here. With Gloo (CPU
ranks, or CUDA tensors it stages through the host) the wait is guarded by the MPI
communicator's watchdog with `runtime.collective_timeout`, as an MPI collective is: at
the deadline it probes every rank and ends the job naming the rank that never arrived
or does not answer (stopped, hung). Gloo's own deadline is set later
(torch_pg.group_timeout), its error the fallback, raised as `CollectiveError` naming
the collective (`what`), the rank and the group, which fail-together turns into the
job's end. With NCCL the wait only orders the device's stream (the host does not
block): the host waits where the loop reads a step's results, under the watchdog
(step_reports.py), and NCCL's watchdog ends the process later, at the group's timeout
(torch_pg.py). Costs per collective: the Protocol's docstring; uneven counts (never
ZeRO's, whose pieces are equal) pad to the largest piece, as the process groups gather
equal pieces.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import HpctrainError
from ..runtime.comm import under_deadline
from .gradient_engine import PROCESS_GROUP_ENGINES
from .torch_arrays import TorchArrays
from .torch_pg import axis_of, check_backend, grid_groups, group_timeout, init_process_group

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed the equal-split collectives (the old names warn)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(HpctrainError, RuntimeError):
    """A process-group operation that failed or passed its deadline: one line naming the
    operation and its peer (it was an "uncaught exception" traceback), which ends the job
    (this rank alone knows it: failfast aborts every rank)."""


class TorchPending:
    """A started operation (the exchange layer's `Pending`); `wait()` has the deadline
    and runs `finish` (copying padded pieces out) once the operation is done."""

    def __init__(self, result, work=None, transport=None, what: str = "", finish=None, p2p=False):
        self._result, self._work, self._transport = result, work, transport
        self._what, self._finish, self._p2p = what, finish, p2p

    def test(self) -> bool:
        if self._work is not None and self._work.is_completed():
            return self.wait() is not None
        return self._work is None

    def wait(self):
        work, self._work = self._work, None
        if work is not None:
            self._transport.wait_work(work, self._what, self._p2p)
            if self._finish is not None:
                self._finish()
        return self._result


class ProcessGroupTransport(TorchArrays):
    """`Transport` over tensors on `device`, across `comm`'s ranks (a guarded MPI
    communicator, which bootstraps the group), with `engine` nccl or gloo; its array
    seam is torch's (TorchArrays)."""

    def __init__(self, comm, engine: str, timeout_s: float, device: torch.device, group=None):
        check_backend(engine, device)
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.size if comm is not None else 1
        self.name, self.device = engine, device
        self.timeout = timedelta(seconds=group_timeout(timeout_s))
        self.p2p_timeout = timedelta(seconds=float(timeout_s))
        self.watchdog = getattr(comm, "watchdog", None)  # the MPI communicator's
        self.group = group
        if group is None and self.size > 1:
            self.group = init_process_group(comm, engine, timeout_s)
            first_sums({"replicas": self}, comm)

    def wait_work(self, work, what: str, p2p: bool = False) -> None:
        """Wait for `work` under the deadline; a failure names `what` and this rank.
        A point-to-point wait (`p2p`, `what` names the peer) has its own deadline,
        runtime.collective_timeout, outside the watchdog, whose sections are collectives
        every rank enters (as the MPI engine's point-to-point waits, runtime/comm.py)."""
        timeout = self.p2p_timeout if p2p else self.timeout
        try:
            if self.name == "nccl":
                work.wait()  # stream order only; NCCL's watchdog holds the group timeout
                return
            if p2p:
                work.wait(timeout)
                return
            with under_deadline(self, what):  # Gloo's wait blocks this thread
                work.wait(timeout)
        except Exception as exc:  # RuntimeError, DistBackendError, a timeout
            margin = "" if p2p else f" and {self.name}'s margin"
            raise CollectiveError(
                f"{self.name} '{what}' failed on rank {self.rank} of {self.size} (deadline "
                f"{timeout.total_seconds():g} s: runtime.collective_timeout{margin}): {exc}"
            ) from exc

    def _run(self, work, result, what: str, wait: bool, finish=None):
        pending = TorchPending(result, work, self, what, finish)
        return pending.wait() if wait else pending

    # --- collectives ------------------------------------------------------------------
    def allreduce_inplace(self, buf, op: str = "sum", what: str = "allreduce"):
        return self._allreduce(buf, op, what, True)

    def start_allreduce_inplace(self, buf, op: str = "sum", what: str = "allreduce"):
        return self._allreduce(buf, op, what, False)

    def _allreduce(self, buf, op, what, wait):
        if self.size == 1:
            return buf if wait else TorchPending(buf)
        work = dist.all_reduce(buf, op=_OPS[op], group=self.group, async_op=True)
        return self._run(work, buf, what, wait)

    def reduce_scatter_sum(self, buf, counts: list[int], what: str):
        mine = torch.empty(int(counts[self.rank]), dtype=buf.dtype, device=buf.device)
        if self.size == 1:
            return mine.copy_(buf[: mine.numel()])
        k = max(counts)
        if any(c != k for c in counts):  # pad every rank's slice to the largest
            padded = torch.zeros(k * self.size, dtype=buf.dtype, device=buf.device)
            self._spread(buf, padded, counts, k)
            out = torch.empty(k, dtype=buf.dtype, device=buf.device)
            work = _REDUCE_SCATTER(out, padded, group=self.group, async_op=True)
            self._run(work, out, what, True)
            return mine.copy_(out[: mine.numel()])
        work = _REDUCE_SCATTER(mine, buf[: k * self.size], group=self.group, async_op=True)
        return self._run(work, mine, what, True)

    def allgather_into(self, mine, buf, counts: list[int], what: str):
        return self._allgather(mine, buf, counts, what, True)

    def start_allgather_into(self, mine, buf, counts: list[int], what: str):
        return self._allgather(mine, buf, counts, what, False)

    def _allgather(self, mine, buf, counts, what, wait):
        if self.size == 1:
            buf[: mine.numel()] = mine
            return buf if wait else TorchPending(buf)
        k = max(counts)
        if all(c == k for c in counts):
            work = _ALL_GATHER(buf[: k * self.size], mine, group=self.group, async_op=True)
            return self._run(work, buf, what, wait)
        send = torch.zeros(k, dtype=mine.dtype, device=mine.device)
        send[: mine.numel()] = mine
        out = torch.empty(k * self.size, dtype=mine.dtype, device=mine.device)
        work = _ALL_GATHER(out, send, group=self.group, async_op=True)
        return self._run(work, buf, what, wait, lambda: self._gather_pieces(out, buf, counts, k))

    @staticmethod
    def _spread(buf, padded, counts, k) -> None:
        """Rank-ordered slices of `buf` (counts) into `padded`, one per k elements."""
        at = 0
        for r, c in enumerate(counts):
            padded[r * k : r * k + c] = buf[at : at + c]
            at += c

    @staticmethod
    def _gather_pieces(out, buf, counts, k) -> None:
        at = 0
        for r, c in enumerate(counts):
            buf[at : at + c] = out[r * k : r * k + c]
            at += c

    def all_to_all(self, send, recv, what: str = "all-to-all"):
        return self._all_to_all(send, recv, what, True)

    def start_all_to_all(self, send, recv, what: str = "all-to-all"):
        return self._all_to_all(send, recv, what, False)

    def _all_to_all(self, send, recv, what, wait):
        if self.size == 1:
            recv.copy_(send)
            return recv if wait else TorchPending(recv)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return self._run(work, recv, what, wait)

    def all_to_all_v(self, send, recv, send_counts: list, recv_counts: list, what: str):
        if self.size == 1:
            n = int(send_counts[0])
            recv[:n] = send[:n]
            return recv
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[int(c) for c in recv_counts],
            input_split_sizes=[int(c) for c in send_counts],
            group=self.group,
            async_op=True,
        )
        return self._run(work, recv, what, True)

    # --- point to point (Gloo honours tags; NCCL matches by order) -----------------------
    # Gloo's send and recv hand the tensor's memory to its TCP transport as a host pointer
    # (its collectives stage CUDA tensors themselves, its point-to-point calls do not), so
    # a CUDA message crosses a host copy here: the send copies it out once it is computed
    # (a host wait, as every Gloo exchange of CUDA tensors has), a receive lands in host
    # memory and is copied onto the device when it is waited for.
    def start_send(self, buf, peer: int, tag: int = 0, what: str = "send", peer_name: str = ""):
        data = buf.cpu() if self.name == "gloo" and buf.is_cuda else buf  # Gloo keeps it alive
        work = dist.isend(data, group=self.group, tag=tag, group_dst=peer)
        what = f"{what} (to {peer_name or f'rank {peer}'})"
        return TorchPending(buf, work, self, what, p2p=True)

    def start_recv(self, buf, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""):
        host, finish = buf, None
        if self.name == "gloo" and buf.is_cuda:
            host = torch.empty(buf.shape, dtype=buf.dtype)

            def finish():
                buf.copy_(host)

        work = dist.irecv(host, group=self.group, tag=tag, group_src=peer)
        what = f"{what} (from {peer_name or f'rank {peer}'})"
        return TorchPending(buf, work, self, what, finish, p2p=True)

    def send(self, buf, peer: int, tag: int = 0, what: str = "send", peer_name: str = "") -> None:
        self.start_send(buf, peer, tag, what, peer_name).wait()

    def recv(self, buf, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""):
        return self.start_recv(buf, peer, tag, what, peer_name).wait()


def process_group_transports(cfg, engine: str, device, replicas, groups) -> dict | None:
    """The process-group engine's transports, or None on other engines: {"replicas":
    over the ranks that average dense gradients (`replicas`, a guarded MPI communicator;
    None, one process: a one-rank transport without a group, so that ZeRO's and the
    compressors' buffers stay tensors on the device as at any world size)}, and with
    tensor parallelism (the model's `groups`, a ModelGroups made from the grid)
    {"tensor": over this rank's tensor axis}, with experts their token exchange's axis
    ("expert", or with tensor parallelism "experts-x-tensor") and their copies'
    ("data") too (ModelGroups.transport_axes), each on its own group under the
    job-wide default group (grid_groups)."""
    if engine not in PROCESS_GROUP_ENGINES:
        return None
    timeout = cfg.runtime["collective_timeout"]
    if replicas is None:
        return {"replicas": ProcessGroupTransport(None, engine, timeout, device)}
    if not groups.transport_axes:
        return {"replicas": ProcessGroupTransport(replicas, engine, timeout, device)}
    axes = ("replicas", *groups.transport_axes)
    return grid_transports(cfg, engine, device, groups.grid, axes)


def grid_transports(cfg, engine: str, device, grid, axes) -> dict:
    """{axis: a ProcessGroupTransport over this rank's `axes` of `grid`}, each on its own
    group under the job-wide default group (grid_groups: collective over the job); a
    second group over an axis (torch_pg.SECOND_GROUPS) is named as its caller asks.
    Cost: one one-element sum per group, once (at most 6 per rank at any world size)."""
    check_backend(engine, device)  # before any group: NCCL on CPU ranks is one clear line
    timeout = cfg.runtime["collective_timeout"]
    groups = grid_groups(grid, engine, timeout, axes)
    found = {
        axis: ProcessGroupTransport(grid.axes[axis_of(axis)], engine, timeout, device, group=group)
        for axis, group in groups.items()
    }
    first_sums(found, grid.world)
    return found


def first_sums(transports: dict, world) -> None:
    """Each group's first collective now, in the same order on every rank: NCCL creates
    a group's communicator there, blocking the host until every member calls (no NCCL
    timeout covers it), and inside a step it could wait behind the device's work on
    another group. One watchdog section of `world` (the job's guarded communicator,
    which every rank enters here once) holds them all: a rank that never comes is named
    at runtime.collective_timeout. (Point-to-point links connect on their own, under a
    section of their own: pipeline/transport.StageTransport.connect.)"""
    with under_deadline(world, "the process groups' first sums"):
        for axis, t in transports.items():
            if t.group is not None and axis == axis_of(axis):
                t.allreduce_inplace(t.zeros(1, "float32"), "sum", f"the {axis} group's first sum")
