"""The pipeline's links over real Gloo groups in every rank of a job (np 2 and 4, one
stage per rank): activations on the pipe axis's group, gradients on its second group
(torch_pg.SECOND_GROUPS), with receives posted ahead (MPI's and Gloo's order) and
without (NCCL's: pipeline/transport.py). Every stage gets every micro-batch's input and
output gradient with the values the chain of stages gives, under both schedules.
tests/test_pipeline_stream_order.py plays the same calls under NCCL's stream rules."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpctrain.backends.torch_pg import grid_groups
from hpctrain.backends.torch_transport import CollectiveError, ProcessGroupTransport
from hpctrain.pipeline.engine import run_step
from hpctrain.pipeline.schedule import SCHEDULES, stage_actions
from hpctrain.pipeline.transport import StageTransport
from hpctrain.runtime import world
from hpctrain.runtime.grid import ProcessGrid

CPU = torch.device("cpu")
SHAPE = (3, 2)
MICRO = 5


@pytest.fixture(scope="module")
def links():
    w = world()
    grid = ProcessGrid(w, pipe=w.size)
    groups = grid_groups(grid, "gloo", 60.0, ("pipe", "pipe-back"))
    assert groups["pipe"] is not groups["pipe-back"]  # a whole-job axis: a group of its own
    yield {
        axis: ProcessGroupTransport(grid.axes["pipe"], "gloo", 60.0, CPU, group=group)
        for axis, group in groups.items()
    }
    dist.destroy_process_group()


class Stage:
    """x -> 2x + 1 forward, g -> 3g backward; the last stage's loss gradient is i + 1."""

    def __init__(self, last: bool):
        self.last, self.inputs, self.grads = last, {}, {}

    def forward(self, i, x, y, scale):
        x = torch.as_tensor(x).clone()
        self.inputs[i] = x
        return 2 * x + 1

    def backward(self, i, grad):
        self.grads[i] = None if grad is None else grad.clone()
        return torch.full(SHAPE, float(i + 1)) if self.last else 3 * grad


@pytest.mark.parametrize("post_ahead", [True, False])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_gets_every_input_and_gradient(links, schedule, post_ahead):
    w = world()
    s, stages = w.rank, w.size
    link = StageTransport(
        links["pipe"], s, stages, SHAPE, SHAPE, back=links["pipe-back"], post_ahead=post_ahead
    )  # fmt: skip
    link.connect()  # one element each way on each link, as the pipeline starts
    stage = Stage(last=s == stages - 1)
    batch = [(torch.full(SHAPE, float(10 * i)), None) for i in range(MICRO)]
    run_step(stage, link, stage_actions(schedule, s, stages, MICRO), batch, MICRO, 1.0)
    for i in range(MICRO):
        x = 10.0 * i
        for _ in range(s):
            x = 2 * x + 1
        assert torch.equal(stage.inputs[i], torch.full(SHAPE, x)), (i, stage.inputs[i])
        if s < stages - 1:
            want = float(i + 1) * 3 ** (stages - 2 - s)
            assert torch.equal(stage.grads[i], torch.full(SHAPE, want)), (i, stage.grads[i])
    w.barrier("pipeline links step")


def test_point_to_point_waits_stay_out_of_the_watchdog_and_name_the_peer(links):
    """A link's waits are not collectives every rank enters: they leave the pipe axis's
    watchdog sections alone (a stall report would otherwise blame a rank that never had
    to come), and a receive nobody answers fails at its own deadline naming the peer."""
    w = world()
    s, stages = w.rank, w.size
    pipe = links["pipe"]
    watchdog = pipe.watchdog
    before = watchdog._seq
    link = StageTransport(pipe, s, stages, SHAPE, SHAPE, back=links["pipe-back"])
    link.connect()
    assert watchdog._seq == before  # no section per send or receive
    if s == 0:  # nobody sends this: the wait ends at the deadline, naming the peer
        comm = SimpleNamespace(rank=pipe.rank, size=pipe.size)  # the same group, 1 s
        short = ProcessGroupTransport(comm, "gloo", 1.0, CPU, group=pipe.group)
        with pytest.raises(CollectiveError, match=r"'probe \(from stage 1\)' failed on rank 0"):
            short.recv(torch.zeros(1), 1, tag=99, what="probe", peer_name="stage 1")
    w.barrier("p2p deadline")
