"""The pipeline's point-to-point order, played under NCCL's stream semantics.

On NCCL a wait never blocks the host, so each rank issues its whole step at once and
the device runs it. The rules played here: each group's point-to-point calls run in
issue order on one stream per rank (the strictest case: per-peer streams only remove
orderings); a send and its receive, matched per pair by issue order (NCCL ignores
tags), complete together once both reach the head of their streams (a rendezvous:
NCCL may finish a small send earlier, never later); a call waits for the compute
issued before it, and compute issued after a wait waits for that call.

The calls are recorded from the real engine (StageTransport.connect, then
pipeline/engine.run_step over pipeline/transport.StageTransport) with a transport that
only records, for both
schedules, 2 to 6 stages and 1 to 8 micro-batches. With the order the pipeline uses on
NCCL (each receive where its data is used, gradients on a second group) every call
completes. The same player finds the deadlock of one group with receives posted one
micro-batch ahead (the order that suits MPI and Gloo), and of either change alone.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpctrain.pipeline.engine import run_inference, run_step
from hpctrain.pipeline.schedule import SCHEDULES, stage_actions
from hpctrain.pipeline.transport import StageTransport

pytestmark = pytest.mark.quick
SHAPE = (2, 3)


class Op:
    def __init__(self, stream, deps=(), kind="compute", peer=None):
        self.stream, self.deps, self.kind, self.peer = stream, list(deps), kind, peer
        self.match: Op | None = None
        self.done = False


class Device:
    """Every rank's recorded streams: one compute stream and one per group."""

    def __init__(self):
        self.streams: dict[tuple, list[Op]] = {}

    def issue(self, stream, **kw) -> Op:
        op = Op(stream, **kw)
        self.streams.setdefault(stream, []).append(op)
        return op

    def last_compute(self, rank) -> list[Op]:
        ops = self.streams.get((rank, "compute"), [])
        return ops[-1:]

    def play(self) -> list[str]:
        """Run every stream to its end under the rules above; the heads left (empty:
        everything completed)."""
        self._match()
        heads = dict.fromkeys(self.streams, 0)
        progress = True
        while progress:
            progress = False
            for key, ops in self.streams.items():
                if heads[key] == len(ops):
                    continue
                op = ops[heads[key]]
                if not all(d.done for d in op.deps):
                    continue
                if op.match is not None:
                    other = op.match
                    at = self.streams[other.stream]
                    if heads[other.stream] == len(at) or at[heads[other.stream]] is not other:
                        continue
                    if not all(d.done for d in other.deps):
                        continue
                    other.done = True
                    heads[other.stream] += 1
                op.done = True
                heads[key] += 1
                progress = True
        return [
            f"{key}: {ops[heads[key]].kind}" for key, ops in self.streams.items()
            if heads[key] < len(ops)
        ]  # fmt: skip

    def _match(self) -> None:
        """The k-th send from a to b on a group meets the k-th receive at b from a."""
        queues: dict[tuple, list[Op]] = {}
        for (rank, group), ops in self.streams.items():
            for op in ops:
                if op.kind in ("send", "recv"):
                    src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                    queues.setdefault((group, src, dst, op.kind), []).append(op)
        for (group, src, dst, kind), sends in queues.items():
            if kind != "send":
                continue
            recvs = queues.get((group, src, dst, "recv"), [])
            assert len(sends) == len(recvs), (group, src, dst)
            for s, r in zip(sends, recvs, strict=True):
                s.match, r.match = r, s


class Pending:
    def __init__(self, device, rank, op):
        self.device, self.rank, self.op = device, rank, op

    def test(self) -> bool:
        return False  # the host cannot see the device's progress without a wait

    def wait(self):
        # the compute stream waits for the call (torch's work.wait() on NCCL)
        self.device.issue((self.rank, "compute"), deps=[self.op], kind="wait")


class RecordingTransport:
    """A rank's group over the stage ranks that records calls instead of making them."""

    def __init__(self, device: Device, rank: int, group: str):
        self.device, self.rank, self.group = device, rank, group

    def zeros(self, n, dtype):
        return np.zeros(n, dtype)

    def from_host(self, arr):
        return arr

    def _call(self, kind, peer):
        deps = self.device.last_compute(self.rank)  # the NCCL stream waits for compute
        op = self.device.issue((self.rank, self.group), deps=deps, kind=kind, peer=peer)
        return Pending(self.device, self.rank, op)

    def start_send(self, buf, peer, tag=0, what="", peer_name=""):
        return self._call("send", peer)

    def start_recv(self, buf, peer, tag=0, what="", peer_name=""):
        return self._call("recv", peer)


class Stage:
    """Compute that only records itself."""

    def __init__(self, device, rank):
        self.device, self.rank = device, rank

    def _compute(self):
        self.device.issue((self.rank, "compute"))
        return np.zeros(SHAPE, np.float32)

    def forward(self, i, x, y, scale):
        return self._compute()

    def backward(self, i, grad):
        return self._compute()

    def infer(self, x):
        return self._compute()


def _links(device, stages, second_group: bool, post_ahead: bool):
    for s in range(stages):
        pipe = RecordingTransport(device, s, "pipe")
        back = RecordingTransport(device, s, "pipe-back") if second_group else None
        yield s, StageTransport(
            pipe, s, stages, SHAPE, SHAPE, back=back, post_ahead=post_ahead
        )  # fmt: skip


def _play_step(schedule, stages, micro, second_group, post_ahead) -> list[str]:
    device = Device()
    batch = [(np.zeros(SHAPE, np.float32), None)] * micro
    for s, link in _links(device, stages, second_group, post_ahead):
        link.connect()  # as the pipeline does, before its first step
        run_step(
            Stage(device, s), link, stage_actions(schedule, s, stages, micro), batch, micro, 1.0
        )
    return device.play()


CASES = list(itertools.product(SCHEDULES, range(2, 7), range(1, 9)))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_nccl_order_completes_every_step(schedule):
    for _, stages, micro in (c for c in CASES if c[0] == schedule):
        stuck = _play_step(schedule, stages, micro, second_group=True, post_ahead=False)
        assert not stuck, (schedule, stages, micro, stuck)


def test_the_nccl_order_completes_inference():
    device = Device()
    batches = [(np.zeros(SHAPE, np.float32), None)] * 5
    for s, link in _links(device, 4, second_group=True, post_ahead=False):
        run_inference(Stage(device, s), link, batches if s == 0 else None, 5, SHAPE[0])
    assert not device.play()


def test_one_group_with_receives_ahead_would_deadlock_on_nccl():
    """The order that suits MPI and Gloo (receives posted ahead, one group both ways)
    sticks on NCCL's in-order streams: a stage's first receive of a gradient sits ahead
    of its sends of activations that the gradient waits for."""
    stuck = [c for c in CASES if _play_step(*c, second_group=False, post_ahead=True)]
    assert len(stuck) == len(CASES)  # every multi-stage step


@pytest.mark.parametrize(
    "second_group, post_ahead, first_stuck",
    [(True, True, ("1f1b", 4, 5)), (False, False, ("1f1b", 2, 2))],
)
def test_either_change_alone_is_not_enough(second_group, post_ahead, first_stuck):
    """With receives ahead, a second group still sticks from 4 stages and 5
    micro-batches of 1F1B on (a receive of an activation ahead of a send of one, whose
    chain of waits returns through the gradients); receives where used on one group
    stick wherever a stage both sends activations and receives gradients in 1F1B."""
    stuck = [c for c in CASES if _play_step(*c, second_group, post_ahead)]
    assert stuck and stuck[0] == first_stuck, stuck
    assert all(schedule == "1f1b" for schedule, _, _ in stuck)


def test_without_posting_ahead_each_receive_is_issued_where_its_data_is_used():
    device = Device()
    _, link = list(_links(device, 2, True, post_ahead=False))[1]
    link.post_activation(0)
    link.post_gradient(0)
    assert device.streams == {}  # nothing posted early
    link.activation(0)
    assert [op.kind for op in device.streams[(1, "pipe")]] == ["recv"]
