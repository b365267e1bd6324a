"""The host memory a gathered checkpoint costs rank 0 (strategies/checkpoint_memory.py),
counted by the limit check before any compute: which layouts hold a copy, and the
state's size against a real torch model. Measured against real runs:
tests/test_memory_plan_jobs.py (rank 0's peak) and tests/test_memory_limit_jobs.py
(the refusal)."""

from __future__ import annotations

import pytest

from hpctrain.config import Config
from hpctrain.data import benchmark_input_spec
from hpctrain.models import zoo
from hpctrain.strategies.checkpoint_memory import (
    checkpoint_copies,
    checkpoint_hint,
    checkpoint_host_bytes,
    model_state_bytes,
)


def _ckpt(**values) -> dict:
    return {**Config.load(None, []).checkpoint, **values}


@pytest.mark.parametrize(
    "values, rank, size, gpu, gathers, copies",
    [
        ({}, 0, 2, False, True, 0),  # sharded: every rank writes its own part
        ({}, 0, 1, False, False, 0),  # one rank, views of its live tensors
        ({}, 0, 1, False, True, 1),  # one rank, ZeRO's arrays are fresh
        ({}, 0, 1, True, False, 1),  # one GPU rank: host copies
        ({"async": True}, 0, 2, False, False, 1),  # the save's private copy of views
        ({"async": True}, 0, 2, False, True, 1),  # the gathered arrays are the copy
        ({"async": True}, 0, 2, True, False, 2),  # pinned staging + the private copy
        ({"async": True}, 1, 2, False, True, 0),  # only rank 0 writes
        ({"sharded": False}, 0, 4, False, True, 1),
        ({"sharded": False}, 0, 4, False, False, 0),
        ({"async": True, "enabled": False}, 0, 2, True, True, 0),
    ],
)
def test_which_layouts_hold_a_copy_on_rank_zero(values, rank, size, gpu, gathers, copies):
    assert checkpoint_copies(_ckpt(**values), rank, size, gpu, gathers) == copies


@pytest.mark.parametrize(
    "sets",
    [
        ["model.name=resnet", "data.task=images", "optimizer.name=sgd", "optimizer.momentum=0.9"],
        [
            "model.name=transformer",
            "data.task=tokens",
            "optimizer.name=adam",
            "model.moe.experts=4",
            "parallel.expert=2",
        ],  # fmt: skip
        ["model.name=mlp", "optimizer.name=sgd", "optimizer.momentum=0"],
    ],
    ids=["resnet-momentum", "moe-adam", "mlp-sgd-without-momentum"],
)
def test_the_state_size_is_a_built_models_with_its_optimizer_slots(sets):
    """Every parameter (all experts, whatever the expert layout), each optimizer slot as
    the torch backend exports it after a step (plain SGD's momentum as zeros) and the
    buffers (BatchNorm's statistics)."""
    import torch

    from hpctrain.backends.torch_model import ZooNet
    from hpctrain.backends.torch_steps import export_optimizer_state, make_optimizer

    cfg = Config.load(None, sets)
    inp = benchmark_input_spec(cfg.data)
    net = ZooNet(zoo.build_layers(cfg.model, inp))
    opt = make_optimizer(cfg.optimizer, list(net.parameters()))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    slots = export_optimizer_state(opt, net.named_parameters(), cfg.optimizer["name"])
    large = sum(v.nbytes for v in slots.values() if v.size > 1)  # not Adam's step count
    built = sum(t.numel() * 4 for t in net.state_dict().values()) + large
    assert model_state_bytes(cfg, inp) == built


def test_a_users_model_and_a_sharded_save_cost_nothing():
    cfg = Config.load(None, ["model.name=mymodels:Net", "checkpoint.async=true"])
    assert checkpoint_host_bytes(cfg, benchmark_input_spec(cfg.data), 0, 2, False, True) == 0
    cfg = Config.load(None, [])
    assert checkpoint_host_bytes(cfg, benchmark_input_spec(cfg.data), 0, 2, False, True) == 0
    both = checkpoint_hint(_ckpt(**{"async": True, "sharded": False}), 4)
    assert "checkpoint.async=false and checkpoint.sharded=true" in both
    assert "checkpoint.async=false (" in checkpoint_hint(_ckpt(**{"async": True}), 4)
    assert "checkpoint.sharded=true (" in checkpoint_hint(_ckpt(sharded=False), 4)
    assert "checkpoint.enabled=false" in checkpoint_hint(_ckpt(), 1)  # one rank: its whole state


def test_error_feedback_makes_an_async_save_synchronous_and_plain_sgd_saves_its_slots():
    inp = benchmark_input_spec(Config.load(None, []).data)
    sets = ["checkpoint.async=true", "model.name=mlp"]
    base = Config.load(None, sets)
    state = model_state_bytes(base, inp)
    assert checkpoint_host_bytes(base, inp, 0, 2, False, False) == state
    for compression in (["train.compression=topk"], ["train.compression=powersgd"]):
        cfg = Config.load(None, [*sets, *compression])  # residuals saved per rank: no copy
        assert checkpoint_host_bytes(cfg, inp, 0, 2, False, False) == 0
        assert checkpoint_host_bytes(cfg, inp, 0, 2, True, False) == state  # off the GPU
    no_feedback = Config.load(None, [*sets, "train.compression=topk",
                                     "compression.error_feedback=false"])  # fmt: skip
    assert checkpoint_host_bytes(no_feedback, inp, 0, 2, False, False) == state
    plain = Config.load(None, ["model.name=mlp", "optimizer.name=sgd", "optimizer.momentum=0"])
    weights = model_state_bytes(plain, inp) / 2  # momentum buffers are saved, zeros
    assert weights == 4.0 * sum(s.param_count() for s in zoo.build_layers(plain.model, inp))
