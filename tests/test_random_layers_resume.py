"""User models with random layers resume bit for bit in both backends, under mpirun np=2:
train 12 steps and stop (checkpoint at 12), resume to the end, and compare every
weight and every step's loss with an uninterrupted run."""

import json

import numpy as np
import pytest
from mpirun import PYTHON, ROOT, mpirun

from hpctrain.checkpoint import load

SCRIPT = str(ROOT / "tests" / "scripts" / "train_dump.py")
BASE = [
    "data.train_samples=384",
    "data.val_samples=64",
    "train.log_every=1",
    "train.epochs=2",
    "train.batch_size=16",
    "optimizer.lr_scaling=none",
    "optimizer.name=adam",
    "optimizer.lr=0.003",
    "metrics.tensorboard=false",
    "checkpoint.every_steps=6",
    "checkpoint.keep_last=null",
]
ENV = {"PYTHONPATH": str(ROOT / "tests")}


def _run(tmp_path, name, run_dir, *overrides, resume=None):
    out = tmp_path / f"{name}.npz"
    args = [SCRIPT, str(out), "--run-dir", str(run_dir)]
    if resume:
        args += ["--resume", resume]
    for o in [*BASE, *overrides]:
        args += ["--set", o]
    job = mpirun(2, PYTHON, *args, timeout=400, env=ENV)
    assert job.returncode == 0, job.output
    with np.load(out) as f:
        return {k: f[k] for k in f.files}, job


def _step_losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return {x["step"]: x["loss"] for x in lines if x["event"] == "step"}


@pytest.mark.parametrize(
    "backend,model",
    [
        ("torch", "torch_dropout"),
        ("tensorflow", "keras_dropout"),
        ("tensorflow", "keras_unseeded_noise"),
    ],
)
def test_random_layers_resume_bit_for_bit(tmp_path, backend, model):
    common = [f"backend={backend}", f"model.name=random_layer_models:{model}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref, _ = _run(tmp_path, "ref", ref_dir, *common)
    _run(tmp_path, "part1", run_dir, *common, "train.max_steps=12")
    final, job = _run(tmp_path, "part2", run_dir, *common, resume="auto")
    assert "ckpt-00000012.h5" in job.output, job.output
    ref_losses, losses = _step_losses(ref_dir), _step_losses(run_dir)
    assert len(ref_losses) == 24  # 2 epochs x 384 / (16 x 2)
    assert losses == ref_losses  # every step identical, before and after the resume
    for k in ref:
        np.testing.assert_array_equal(final[k], ref[k], err_msg=k)  # bit for bit
    # each replica its own stream for its random layers (the build seeds every rank
    # alike for equal weights; the masks of different samples must not be equal)
    saved = load(run_dir / "checkpoints" / "ckpt-00000012.h5").rng
    layers = [k for k in saved[0] if not k.startswith(("python.", "numpy."))]
    assert layers and any(not np.array_equal(saved[0][k], saved[1][k]) for k in layers), layers
