"""Exports that round-trip: a model trained under mpirun, exported with `hpctrain ckpt
export --to torch|keras`, loaded in plain torch / plain Keras (no hpctrain), predicts what
hpctrain predicts from the same checkpoint, within 1e-5. Zoo and user models, both
backends, and across: torch-trained to Keras, TensorFlow-trained to torch."""

from __future__ import annotations

import json
import os

import first_hour_models
import h5py
import numpy as np
import pytest
import yaml
from mpirun import HPCTRAIN, ROOT, mpirun

from hpctrain.checkpoint import find_latest_valid
from hpctrain.cli import main as cli_main
from hpctrain.config import Config
from hpctrain.models.zoo import InputSpec

FEATURES, CLASSES, WIDTH = 20, 3, 16
MODELS = {  # (backend, model) -> model.* settings
    ("torch", "zoo"): ["model.name=mlp", f"model.hidden=[{WIDTH}]"],
    ("tensorflow", "zoo"): ["model.name=mlp", f"model.hidden=[{WIDTH}]"],
    ("torch", "user"): ["model.name=first_hour_models:torch_sized", f"model.width={WIDTH}"],
    ("tensorflow", "user"): ["model.name=first_hour_models:keras_sized", f"model.width={WIDTH}"],
}


def _data(path):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(600, FEATURES)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, np.argmax(x @ w, axis=1)
    return x[:50]


def _train(tmp_path, backend, kind):
    x = _data(tmp_path / "d.h5")
    run = tmp_path / "run"
    sets = [f"backend={backend}", *MODELS[(backend, kind)], "data.source=hdf5"]
    sets += [f"data.path={tmp_path / 'd.h5'}", "train.epochs=2", "train.batch_size=32"]
    sets += ["metrics.tensorboard=false"]
    args = [HPCTRAIN, "train", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    job = mpirun(2, *args, cwd=ROOT / "tests", timeout=300)
    assert job.returncode == 0, job.output
    ckpt = find_latest_valid(run / "checkpoints")
    assert ckpt is not None and ckpt.step > 0, job.output
    return ckpt, x


def _hpctrain_predictions(ckpt, x) -> np.ndarray:
    """What hpctrain's own backend predicts from the checkpoint's weights."""
    from hpctrain.backends import backend_class

    cfg = Config(yaml.safe_load(ckpt.config_yaml)).replace(["train.allreduce=mpi"])
    backend = backend_class(cfg.backend)(cfg, None, InputSpec((FEATURES,), CLASSES), 1)
    backend.set_weights(ckpt.model_weights())
    return backend.predict(x)


# --- plain torch and plain Keras: what a user writes, nothing from hpctrain ---------------------
def _plain_torch(kind_of_names: str):
    import torch
    from torch import nn

    if kind_of_names == "torch_sized":
        return first_hour_models.torch_sized((FEATURES,), CLASSES, WIDTH)

    class Net(nn.Module):
        def __init__(self, first: str, last: str):
            super().__init__()
            self.first, self.last = first, last
            self.add_module(first, nn.Linear(FEATURES, WIDTH))
            self.add_module(last, nn.Linear(WIDTH, CLASSES))

        def forward(self, x):
            h = torch.relu(getattr(self, self.first)(x.flatten(1)))
            return getattr(self, self.last)(h)

    # the zoo mlp's layers are fc1 and head; the user's Keras model's dense1 and out
    return Net("fc1", "head") if kind_of_names == "zoo" else Net("dense1", "out")


def _plain_keras(kind_of_names: str):
    import keras

    if kind_of_names == "keras_sized":
        return first_hour_models.keras_sized((FEATURES,), CLASSES, WIDTH)
    first, last = ("fc1", "head") if kind_of_names == "zoo" else ("1", "3")  # nn.Sequential
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(WIDTH, activation="relu", name=first),
            keras.layers.Dense(CLASSES, name=last),
        ]
    )


def load_keras_export(model, path) -> dict:
    """The recipe of docs/bring-your-own.md, verbatim."""
    with h5py.File(path, "r") as f:
        layers = json.loads(f.attrs["keras_layers"])
        for layer, names in layers.items():
            target = model
            for part in layer.split("/"):  # nested layers: outer/inner
                target = target.get_layer(part)
            target.set_weights([f[n][()] for n in names])
    return layers


@pytest.mark.parametrize("backend, kind", list(MODELS))
def test_exports_reload_in_plain_torch_and_keras_with_hpctrains_predictions(
    tmp_path, backend, kind
):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import torch

    ckpt, x = _train(tmp_path, backend, kind)
    want = _hpctrain_predictions(ckpt, x)
    names = {("torch", "user"): "torch_sized", ("tensorflow", "user"): "keras_sized"}
    torch_names = names.get((backend, kind), "zoo")
    keras_names = names.get((backend, kind), "zoo")
    if (backend, kind) == ("tensorflow", "user"):
        torch_names = "keras_layer_names"
    if (backend, kind) == ("torch", "user"):
        keras_names = "torch_sequential_names"

    out = tmp_path / "model.pt"
    assert cli_main(["ckpt", "export", str(ckpt.path), "--to", "torch", str(out)]) == 0
    net = _plain_torch(torch_names)
    net.load_state_dict(torch.load(out, weights_only=True))  # strict: every name, every shape
    with torch.no_grad():
        got = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    out = tmp_path / "model-keras.h5"
    assert cli_main(["ckpt", "export", str(ckpt.path), "--to", "keras", str(out)]) == 0
    kmodel = _plain_keras(keras_names)
    layers = load_keras_export(kmodel, out)
    assert len(layers) == 2, layers
    if (backend, kind) == ("tensorflow", "user"):  # the model: kernels as Keras has them
        assert layers == {
            "dense1": ["dense1/kernel", "dense1/bias"],
            "out": ["out/kernel", "out/bias"],
        }
        with h5py.File(out, "r") as f:
            assert f["dense1/kernel"].shape == (FEATURES, WIDTH)
    got = kmodel.predict(x, verbose=0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # and the model learned something (the comparison is not between untrained weights)
    assert np.abs(want).max() > 0.1
