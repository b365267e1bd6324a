"""MoE routing, capacity, auxiliary loss and `model.moe` validation, checked by hand."""

import numpy as np
import pytest

from hpctrain import Config
from hpctrain.errors import ConfigError
from hpctrain.moe import capacity, routing

# 6 tokens, 3 experts; token 5 ties experts 0 and 1 (the lower index wins).
PROBS = np.array(
    [
        [0.6, 0.3, 0.1],
        [0.5, 0.4, 0.1],
        [0.7, 0.1, 0.2],
        [0.2, 0.5, 0.3],
        [0.1, 0.3, 0.6],
        [0.45, 0.45, 0.1],
    ],
    dtype=np.float32,
)


def test_capacity_formula():
    assert capacity(6, 3, 2, 0.5, 0, True) == 2  # ceil(2*6/3*0.5)
    assert capacity(8, 4, 1, 1.25, 0, True) == 3  # ceil(2.5)
    assert capacity(8, 4, 1, 0.1, 4, True) == 4  # min_capacity
    assert capacity(10, 4, 2, 1.2, 0, True) == 6  # exactly 6, not 7 from float noise
    assert capacity(8, 4, 2, 100.0, 0, True) == 8  # never above the tokens
    assert capacity(8, 4, 2, 0.1, 0, False) == 8  # drop_tokens false: nothing dropped


def test_top2_capacity_2_by_hand():
    r = routing.route(PROBS, 2, capacity=2)
    np.testing.assert_array_equal(r.experts, [[0, 1], [0, 1], [0, 2], [1, 2], [2, 1], [0, 1]])
    # First choices in token order: e0 takes tokens 0, 1 (2 and 5 dropped), e1 token 3,
    # e2 token 4. Second choices: token 0 -> e1 and token 2 -> e2 fill them; the rest drop.
    expected_kept = [[1, 1], [1, 0], [0, 1], [1, 0], [1, 0], [0, 0]]
    np.testing.assert_array_equal(r.kept, np.array(expected_kept, bool))
    np.testing.assert_array_equal(r.routed, [4, 5, 3])
    np.testing.assert_array_equal(r.kept_counts, [2, 2, 2])
    assert r.dropped == 6
    np.testing.assert_array_equal(r.send_token, [0, 1, 3, 0, 4, 2])  # packed by expert
    np.testing.assert_array_equal(r.send_slot, [0, 0, 0, 1, 0, 1])


def test_top1_without_capacity_pressure_drops_nothing():
    r = routing.route(PROBS, 1, capacity=6)
    np.testing.assert_array_equal(r.experts[:, 0], [0, 0, 0, 1, 2, 0])
    assert r.dropped == 0 and r.kept.all()
    np.testing.assert_array_equal(r.send_token, [0, 1, 2, 5, 3, 4])


def test_aux_loss_matches_the_switch_formula_by_hand():
    # f = routed / (T*k) = [4, 5, 3] / 12; P = column means = [2.55, 2.05, 1.4] / 6
    # alpha * E * sum f P = 0.01 * 3 * (4*0.425 + 5*2.05/6 + 3*1.4/6) / 12
    value = routing.aux_loss(PROBS, np.array([4, 5, 3]), 2, 0.01)
    assert value == pytest.approx(0.010270833, abs=1e-8)
    uniform = np.full((4, 4), 0.25, np.float32)
    assert routing.aux_loss(uniform, np.array([1, 1, 1, 1]), 1, 0.01) == pytest.approx(0.01)


BASE = ["model.name=transformer", "data.task=tokens"]


@pytest.mark.parametrize(
    "moe,message",
    [
        ("{experts: 2, top_k: 3}", "model.moe.top_k: must be 1 or 2"),
        ("{experts: 1, top_k: 2}", "model.moe.top_k: 2 experts per token but only 1 expert"),
        ("{capacity_factor: 0}", "model.moe.capacity_factor: must be a number > 0"),
        ("{capacity_factor: -1.5}", "model.moe.capacity_factor: must be a number > 0"),
        ("{experts: 0}", "model.moe.experts: expected an integer >= 1"),
        ("{topk: 2}", "model.moe.topk: unknown MoE option"),
        ("{drop_tokens: 1}", "model.moe.drop_tokens: expected true or false"),
        ("[4]", "model.moe: expected a mapping"),
    ],
)
def test_bad_moe_options_are_named(moe, message):
    with pytest.raises(ConfigError) as err:
        Config.load(None, [*BASE, f"model.moe={moe}"])
    assert message in str(err.value)


def test_moe_blocks_have_global_expert_names():
    from hpctrain.models import zoo

    cfg = Config.load(None, [*BASE, "model.moe={experts: 4, every: 2}", "model.n_layers=4"])
    layers = zoo.build_layers(cfg.model, zoo.InputSpec((8,), 16, tokens=True))
    names = zoo.param_names(layers)
    assert "blocks.1.moe.experts.3.fc1.weight" in names
    assert "blocks.1.moe.router.weight" in names
    assert "blocks.0.ffn.fc1.weight" in names and "blocks.0.moe.router.weight" not in names
    assert "blocks.3.moe.experts.0.fc2.bias" in names


def test_a_pipelines_moe_metrics_have_every_key_on_every_rank_and_average_to_its_layers():
    """The loop averages the extras of every rank in one allreduce: a stage without MoE
    layers gives the same keys and sizes as one with them (zeros), and over the job the
    rates average over the MoE stages' ranks while the counts add up over the layers."""
    from hpctrain.moe.parallel import (
        METRIC_KEYS,
        LayerStats,
        MoELayer,
        pipeline_metrics,
        step_metrics,
    )

    class _Group:
        rank, size = 0, 1

    layer = MoELayer({"experts": 4, "top_k": 2}, _Group())
    layer.stats = LayerStats(
        calls=1, tokens=8, choices=16, dropped=2, routed=np.array([4, 4, 4, 4]),
        kept=np.array([4, 4, 3, 3]), capacity_sum=5, aux_loss=0.5,
    )  # fmt: skip
    found = step_metrics([layer], 1.0, 1)
    assert tuple(sorted(found)) == tuple(sorted(METRIC_KEYS))
    empty = pipeline_metrics({}, 4, stages=4, moe_stages=2)
    assert empty.keys() == found.keys() and empty["moe_load"] == [0.0] * 4
    mine = pipeline_metrics(found, 4, stages=4, moe_stages=2)
    # 2 of 4 stages with MoE: the job's mean of 2 such ranks and 2 without
    mean = {k: (mine[k] if k != "moe_load" else mine[k][0]) / 2 for k in ("moe_drop_rate",
            "moe_dropped", "moe_load")}  # fmt: skip
    assert mean["moe_drop_rate"] == pytest.approx(found["moe_drop_rate"])  # averaged
    assert mean["moe_load"] == pytest.approx(found["moe_load"][0])
    assert mean["moe_dropped"] == pytest.approx(2 * found["moe_dropped"])  # both stages'


def test_jitter_noise_continues_after_a_resume_through_the_ranks_random_state():
    """The jitter generator of each MoE layer is part of the rank's checkpointed random
    state (checkpoint/rng.py): a process that restores it before its layers exist (a
    resume) draws the noise the uninterrupted run drew next."""
    from hpctrain.checkpoint import capture_process_rng, restore_process_rng
    from hpctrain.moe.parallel import MoELayer, forget_jitter_rngs

    class _Group:
        rank, size = 1, 2

    opts = {"experts": 4, "top_k": 2, "jitter": 0.5, "seed": 7}
    layer = MoELayer(opts, _Group(), "blocks.0")
    layer.jitter_noise((3, 5))
    saved = capture_process_rng()  # at the checkpoint
    expected = [layer.jitter_noise((3, 5)) for _ in range(2)]
    # the run ends (its layer may live on: a second run in this process); the resumed
    # run reseeds the process (prepare_process forgets the earlier layers), restores,
    # then makes its layers
    forget_jitter_rngs()
    restore_process_rng(saved)
    again = MoELayer(opts, _Group(), "blocks.0")
    for want in expected:
        np.testing.assert_array_equal(again.jitter_noise((3, 5)), want)
    fresh = MoELayer(opts, _Group(), "blocks.0")  # not resumed: its seed's stream
    assert not np.array_equal(fresh.jitter_noise((3, 5)), expected[0])
