"""One `JobShape` counts replicas, stages and tensor ranks for the strategies, the
loop's learning-rate scaling, elastic restart and SLURM's rank checks (no mpirun)."""

from __future__ import annotations

import pytest

from hpctrain.config import Config
from hpctrain.elastic.batch import plan_batch, ranks_per_replica, replicas_of
from hpctrain.shape import JobShape
from hpctrain.slurm.fit import world_size_problems

TP = ["model.name=transformer", "data.task=tokens"]
PIPE_TP = ["strategy=pipeline", "pipeline.stages=2", "parallel.tensor=2", *TP]


@pytest.mark.parametrize(
    "overrides, ranks, per_replica, replicas, tiles",
    [
        ([], 4, 1, 4, True),
        (["parallel.tensor=2", *TP], 8, 2, 4, True),
        (["parallel.tensor=2", *TP], 3, 2, 1, False),
        (["strategy=pipeline", "pipeline.stages=2"], 6, 2, 3, True),
        (["strategy=pipeline", "pipeline.stages=2"], 3, 2, 1, False),
        (PIPE_TP, 8, 4, 2, True),
        (PIPE_TP, 6, 4, 1, False),
        (["strategy=parameter_server", "ps.servers=2"], 5, 1, 3, True),
        (["strategy=parameter_server", "ps.servers=2"], 2, 1, 0, False),
    ],
)
def test_replicas_of_every_strategy(overrides, ranks, per_replica, replicas, tiles):
    shape = JobShape.of(Config.load(None, overrides), ranks)
    assert (shape.ranks_per_replica, shape.replicas, shape.tiles) == (
        per_replica,
        replicas,
        tiles,
    )


def test_global_batch_scales_with_the_replicas():
    cfg = Config.load(None, [*PIPE_TP, "train.batch_size=8"])
    assert JobShape.of(cfg, 16).global_batch(8, 2) == 8 * 2 * 4
    ps = Config.load(None, ["strategy=parameter_server", "ps.servers=1"])
    assert JobShape.of(ps, 4).global_batch(8, 1) == 24  # three workers


@pytest.mark.parametrize("lost", [4, 8])
def test_elastic_restart_of_pipe_x_tensor_keeps_the_global_batch(lost):
    """pipe 2 x tensor 2 on 12 ranks is 3 replicas; losing a node of 4 (or 8) ranks
    leaves 2 (or 1) whose micro-batches take up the lost ones: global batch kept."""
    cfg = Config.load(
        None, [*PIPE_TP, "pipeline.microbatches=2", "train.batch_size=8", "optimizer.lr=0.1"]
    )
    assert ranks_per_replica(cfg) == 4
    first, now = replicas_of(cfg, 12), replicas_of(cfg, 12 - lost)
    assert (first, now) == (3, 3 - lost // 4)
    plan = plan_batch(cfg, first, now)
    assert plan.global_batch == 8 * 2 * 3
    assert plan.microbatches * 8 * now == plan.global_batch
    assert plan.lr * now == pytest.approx(0.1 * 3)  # linear scaling: scaled lr unchanged


def test_slurm_rank_check_counts_the_tensor_groups_of_a_pipeline():
    cfg = Config.load(None, PIPE_TP)
    assert world_size_problems(cfg, 8, "-N 2") == []
    (problem,) = world_size_problems(cfg, 6, "-N 3")
    assert problem == (
        "pipeline.stages=2 x parallel.tensor=2 needs a multiple of 4 ranks (4, 8, 12, ...); "
        "-N 3 gives 6"
    )
    plain = Config.load(None, ["strategy=pipeline"])
    assert world_size_problems(plain, 3, "x")[0].startswith("pipeline.stages=2 needs a multiple")
