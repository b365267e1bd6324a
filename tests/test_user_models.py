"""Users bring their own torch nn.Module or Keras model via model.name: pkg.module:function."""

import json

import pytest
from mpirun import HPCTRAIN, ROOT, mpirun


@pytest.mark.parametrize("backend,fn", [("torch", "torch_net"), ("tensorflow", "keras_net")])
def test_user_model_trains_under_mpirun(tmp_path, backend, fn):
    run = tmp_path / "run"
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(run),
        "--set",
        f"backend={backend}",
        "--set",
        f"model.name=usermodels:{fn}",
        "--set",
        "model.width=16",
        "--set",
        "train.epochs=2",
        "--set",
        "data.train_samples=2048",
        "--set",
        "metrics.tensorboard=false",
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "tests")},
    )
    assert job.returncode == 0, job.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    epochs = [x for x in lines if x["event"] == "epoch"]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert epochs[-1]["val_accuracy"] > 0.3  # chance is 0.1


def test_wrong_kind_of_user_model_is_a_clear_error(tmp_path):
    job = mpirun(
        1,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        "backend=tensorflow",
        "--set",
        "model.name=usermodels:torch_net",
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "tests")},
    )
    assert job.returncode != 0
    assert "not a keras.Model (backend: tensorflow)" in job.output
