"""Whole-model exports that need no hpctrain (`hpctrain ckpt export --to torchscript |
keras-model`, docs/checkpoints.md#leaving-hpctrain).

The demo trained briefly under mpirun, exported, then loaded by a Python that cannot
import hpctrain (`-I -S`, only the virtual environment's site-packages on its path, so
the editable install's path hook never runs; cwd elsewhere): it reads the validation
split with h5py and gets hpctrain's validation accuracy from both files. The other zoo
models are checked in this process against the training backend's own forward pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import numpy as np
import pytest
import yaml
from mpirun import HPCTRAIN, ROOT, mpirun

from hpctrain.checkpoint import find_latest_valid
from hpctrain.cli import main as cli_main
from hpctrain.errors import CheckpointError
from hpctrain.models import zoo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Runs in a Python without hpctrain: what a user who left hpctrain writes.
STANDALONE = textwrap.dedent(
    """
    import json, os, sys

    sys.path.append(sys.argv[1])  # site-packages only; no .pth files, no editable hook
    try:
        import hpctrain  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("hpctrain is importable: " + hpctrain.__file__)
    import h5py, keras, numpy as np, torch

    data, ts_path, keras_path, state_path = sys.argv[2:6]
    with h5py.File(data, "r") as f:
        x, y = f["val/x"][()], f["val/y"][()]
    scripted = torch.jit.load(ts_path)
    with torch.no_grad():
        ts_logits = scripted(torch.from_numpy(x)).numpy()
    model = keras.models.load_model(keras_path)
    keras_logits = np.asarray(model.predict(x, batch_size=1024, verbose=0))
    # --to torch still gives a state_dict that fits the same module
    scripted.load_state_dict(torch.load(state_path, weights_only=True))
    with torch.no_grad():
        sd_logits = scripted(torch.from_numpy(x)).numpy()
    print(json.dumps({
        "torchscript": float((ts_logits.argmax(1) == y).mean()),
        "keras": float((keras_logits.argmax(1) == y).mean()),
        "state_dict": float((sd_logits.argmax(1) == y).mean()),
        "samples": int(len(y)),
        "training": scripted.training,
        "hpctrain_loaded": any(m.startswith("hpctrain") for m in sys.modules),
        "hpctrain_on_path": [p for p in sys.path if os.path.isdir(os.path.join(p, "hpctrain"))],
    }))
    """
)


def test_demo_exports_reproduce_validation_accuracy_without_hpctrain(tmp_path, capsys):
    run = tmp_path / "run"
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--run-dir",
        str(run),
        "--new",
        "--set",
        "train.max_steps=60",
        "--set",
        "metrics.tensorboard=false",
        timeout=300,
    )
    assert job.returncode == 0, job.output
    ckpt = find_latest_valid(run / "checkpoints")
    assert ckpt is not None and ckpt.step == 60, job.output
    val_accuracy = float(ckpt.attrs["metric.val_accuracy"])
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]["inferred"]["path"]

    out = {k: tmp_path / "export" / f"model{k}" for k in (".ts", ".keras", ".pt")}
    capsys.readouterr()
    for to, path in (("torchscript", ".ts"), ("keras-model", ".keras"), ("torch", ".pt")):
        assert cli_main(["ckpt", "export", str(ckpt.path), "--to", to, str(out[path])]) == 0
    said = capsys.readouterr().out
    assert "load with torch.jit.load(" in said and "keras.models.load_model(" in said, said
    assert "input float32 [N, 32] as hpctrain fed the model (data: float32 features)" in said

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    job = subprocess.run(
        [sys.executable, "-I", "-S", "-c", STANDALONE, sysconfig.get_paths()["purelib"], data]
        + [str(out[k]) for k in (".ts", ".keras", ".pt")],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=180,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    got = json.loads(job.stdout.strip().splitlines()[-1])
    assert not got["hpctrain_loaded"] and not got["training"], got
    assert got["hpctrain_on_path"] == [], got
    assert got["samples"] == 8192
    print(f"hpctrain val_accuracy {val_accuracy:.6f}, standalone {got}")
    for kind in ("torchscript", "keras", "state_dict"):
        assert abs(got[kind] - val_accuracy) <= 1e-3, (kind, got[kind], val_accuracy)
    assert val_accuracy > 0.5  # trained: well above chance (0.10)


# --- every zoo model, against the training backend's forward pass ------------------------
CASES = {
    "mlp": ({"name": "mlp", "hidden": [16, 8]}, zoo.InputSpec((5,), 4)),
    "mlp-images": ({"name": "mlp", "hidden": [16]}, zoo.InputSpec((2, 6, 6), 4)),
    "cnn": ({"name": "cnn", "channels": [4, 8, 8]}, zoo.InputSpec((3, 9, 9), 5)),
    "resnet": ({"name": "resnet", "depth": 8, "width": 4}, zoo.InputSpec((3, 8, 8), 5)),
    "transformer": (
        {"name": "transformer", "d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 24},
        zoo.InputSpec((7,), 11, tokens=True),
    ),
}


def _config(model_cfg: dict, inp: zoo.InputSpec) -> str:
    inferred = {"sample_shape": list(inp.shape), "classes": inp.classes, "tokens": inp.tokens}
    return yaml.safe_dump({"backend": "torch", "model": model_cfg, "data": {"inferred": inferred}})


@pytest.mark.parametrize("case", list(CASES))
def test_every_zoo_model_exports_with_the_backends_forward_pass(tmp_path, case):
    import keras
    import torch

    from hpctrain.backends import export
    from hpctrain.backends.torch import build_model

    model_cfg, inp = CASES[case]
    net = build_model(model_cfg, inp, 0).eval()
    rng = np.random.default_rng(1)
    with torch.no_grad():  # move every weight and BatchNorm statistic off its initial value
        for name, value in net.state_dict().items():
            value.add_(torch.from_numpy(rng.normal(0, 0.3, value.shape).astype(np.float32)))
            if name.endswith("running_var"):
                value.abs_().add_(0.5)
    weights = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    if inp.tokens:
        x = rng.integers(0, inp.classes, (3, *inp.shape))
    else:
        x = rng.normal(size=(3, *inp.shape)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()

    path, _ = export.write_torchscript(weights, tmp_path / "m.ts", _config(model_cfg, inp))
    scripted = torch.jit.load(path)
    with torch.no_grad():
        np.testing.assert_array_equal(scripted(torch.from_numpy(x)).numpy(), want)
    path, _ = export.write_keras_model(weights, tmp_path / "m.keras", _config(model_cfg, inp))
    got = np.asarray(keras.models.load_model(path)(x))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    if inp.tokens:  # shorter sequences: the first positions, causally unchanged
        with torch.no_grad():
            short = scripted(torch.from_numpy(x[:, :4])).numpy()
        np.testing.assert_allclose(short, want[:, :4], rtol=0, atol=1e-6)


def test_what_has_no_standalone_form_is_refused_with_one_line(tmp_path):
    from hpctrain.backends import export

    weights = {"fc1.weight": np.zeros((4, 3), np.float32), "fc1.bias": np.zeros(4, np.float32)}
    user = yaml.safe_dump({"backend": "torch", "model": {"name": "mymodels:net"}})
    with pytest.raises(CheckpointError, match=r"your own \(mymodels:net\); use --to torch"):
        export.write_torchscript(weights, tmp_path / "m.ts", user)
    moe = {"name": "transformer", "moe": {"experts": 2}}
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        export.write_keras_model(weights, tmp_path / "m.keras", yaml.safe_dump({"model": moe}))
    mlp = yaml.safe_dump({"model": {"name": "mlp", "hidden": [4]}})
    with pytest.raises(CheckpointError, match=r"must end in \.keras"):
        export.write_keras_model(weights, tmp_path / "m.h5", mlp)
    with pytest.raises(CheckpointError, match="do not match the mlp"):
        export.write_torchscript(weights, tmp_path / "m.ts", mlp)
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary file
