"""fp16's dynamic loss scaling on one rank (the same code runs on GPU ranks): a step
whose scaled gradients overflow is skipped and the scale backs off, later steps train,
and the scale is checkpointed and restored."""

import numpy as np
import pytest

from hpctrain.config import Config
from hpctrain.errors import ConfigError
from hpctrain.models import zoo


def _backend(*overrides):
    from hpctrain.backends.torch import TorchBackend

    cfg = Config.load(
        "configs/demo.yaml",
        ["train.precision=fp16", "train.allreduce=mpi", "runtime.device=cpu", *overrides],
    )
    return TorchBackend(cfg, None, zoo.InputSpec(shape=(32,), classes=10), threads=1)


def _batch(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((128, 32))).astype(np.float32)
    return [(x, rng.integers(0, 10, 128).astype(np.int64))]


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off():
    b = _backend()
    start = b.get_weights()
    scale0 = b.scaler.get_scale()
    # large inputs: the float16 backward of the 65536-scaled loss overflows
    stats = b.train_step(_batch(scale=300.0), 1e-3)
    assert b.scaler.get_scale() == scale0 / 2
    assert stats.extra["loss_scale"] == scale0 / 2  # in the step metrics: overflows show
    after = b.get_weights()
    assert all(np.array_equal(after[k], start[k]) for k in start)  # skipped, not applied
    for i in range(20):  # the scale settles and training moves the weights
        b.train_step(_batch(seed=i + 1), 1e-3)
    moved = b.get_weights()
    assert any(not np.array_equal(moved[k], start[k]) for k in start)


def test_the_loss_scale_is_checkpointed_and_restored():
    b = _backend()
    b.train_step(_batch(scale=300.0), 1e-3)  # one back-off: the scale is not the default
    state = {k: np.array(v) for k, v in b.export_state().items()}
    assert float(state["optimizer/loss_scale"]) == b.scaler.get_scale() == 2.0**15
    fresh = _backend()
    fresh.import_state(state)
    assert fresh.scaler.get_scale() == 2.0**15
    for k, v in fresh.export_state().items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["backend=tensorflow"], "not with backend tensorflow"),
        (["train.allreduce=horovod"], "not with train.allreduce=horovod"),
        (["train.zero=1"], "not with train.zero=1"),
        # an overflow would poison a compressor's residual or PowerSGD's Q for good, and
        # local steps average no gradients (one rank alone would skip)
        (["train.compression=topk"], "not with train.compression=topk"),
        (["train.compression=powersgd"], "not with train.compression=powersgd"),
        (["train.sync_every=4"], "not with train.sync_every=4"),
    ],
)
def test_fp16_refuses_what_it_does_not_cover(overrides, says):
    with pytest.raises(ConfigError, match=says):
        Config.load("configs/demo.yaml", ["train.precision=fp16", *overrides])
