"""`train.precision: bf16` under real mpirun: forward and backward in bfloat16 on float32
master weights. On the demo task it ends within a point of float32 in both backends;
the backends follow the same trajectory within bfloat16's resolution; parameters,
gradients and optimizer state stay float32 (checkpoints are the usual float32 ones)."""

import pytest
from demo_runs import demo_accuracy
from test_trainer_jobs import _train


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_bf16_reaches_float32_accuracy_on_the_demo(tmp_path_factory, backend):
    fp32 = demo_accuracy(tmp_path_factory, f"backend={backend}")  # shared with other tests
    bf16 = demo_accuracy(tmp_path_factory, f"backend={backend}", "train.precision=bf16")
    assert fp32 > 0.8
    assert bf16 > fp32 - 0.01, (bf16, fp32)


def test_bf16_backends_agree_and_keep_float32_master_weights(tmp_path):
    common = ["train.precision=bf16", "train.max_steps=8", "model.hidden=[64]"]
    wt, lt = _train(tmp_path, "bf16-torch", 2, "backend=torch", *common)
    wf, lf = _train(tmp_path, "bf16-tf", 2, "backend=tensorflow", *common)
    w32, l32 = _train(tmp_path, "fp32-torch", 2, "backend=torch", *common[1:])
    # bfloat16 keeps 8 bits of mantissa: the losses agree to its resolution, and differ
    # from float32's by more than float32 rounding (bf16 really computed).
    assert lt == pytest.approx(lf, rel=2e-2)
    assert lt == pytest.approx(l32, rel=2e-2)
    assert max(abs(a - b) for a, b in zip(lt, l32, strict=True)) > 1e-5
    for k in wt:
        assert wt[k].dtype == wf[k].dtype == w32[k].dtype == "float32"
        assert abs(wt[k] - wf[k]).max() < 2e-2, k


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_bf16_transformer_loss_within_two_percent_of_float32(tmp_path, backend):
    common = [
        f"backend={backend}",
        "model.name=transformer",
        "data.task=tokens",
        "train.max_steps=20",
        "optimizer.name=adam",
        "optimizer.lr=0.003",
    ]
    _, l32 = _train(tmp_path, "fp32", 2, *common)
    _, l16 = _train(tmp_path, "bf16", 2, *common, "train.precision=bf16")
    assert l16[-1] == pytest.approx(l32[-1], rel=0.02), (l16[-1], l32[-1])
    assert l16[-1] < l16[0]  # it learned


def test_bf16_refuses_what_it_does_not_cover():
    from hpctrain.config import Config
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="train.precision=bf16: runs with strategy"):
        Config.load(None, ["train.precision=bf16", "strategy=pipeline"])
