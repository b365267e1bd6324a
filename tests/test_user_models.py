"""Users bring their own torch nn.Module or Keras model via model.name: pkg.module:function."""

import json

import pytest
from mpirun import HPCTRAIN, ROOT, mpirun


# keras_net_with_unused_head: a variable off the loss's path gets zeros (it crashed the
# TensorFlow step with "None values not supported"; torch leaves its gradient None)
@pytest.mark.parametrize(
    "backend,fn",
    [
        ("torch", "torch_net"),
        ("tensorflow", "keras_net"),
        ("tensorflow", "keras_net_with_unused_head"),
    ],
)
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


# --- finding, calling and checking a user's function (framework-free part) ------------------
def test_missing_module_says_how_to_make_it_importable(tmp_path, monkeypatch):
    from hpctrain.errors import ConfigError
    from hpctrain.models.user import resolve

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        resolve("mymodels.nets:build")
    text = str(err.value)
    assert "cannot import 'mymodels.nets'" in text and "PYTHONPATH" in text
    assert "mpirun -x PYTHONPATH" in text and "\n" not in text


def test_the_start_directory_is_importable(tmp_path, monkeypatch):
    from hpctrain.models.user import resolve

    (tmp_path / "fh_cwd_models.py").write_text("def build(width=3):\n    return width\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    assert resolve("fh_cwd_models:build")() == 3


def test_module_problems_are_named(tmp_path, monkeypatch):
    from hpctrain.errors import ConfigError
    from hpctrain.models.user import resolve

    (tmp_path / "fh_raises.py").write_text("import numpy\nraise RuntimeError('bad\\nsecond')\n")
    (tmp_path / "fh_needs.py").write_text("import not_installed_dep\n")
    (tmp_path / "fh_fns.py").write_text("def alpha(): pass\ndef beta(): pass\nX = 1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"importing 'fh_raises' raised RuntimeError: bad \("):
        resolve("fh_raises:f")
    with pytest.raises(ConfigError, match="needs 'not_installed_dep', which is not installed"):
        resolve("fh_needs:f")
    with pytest.raises(ConfigError, match=r"has no 'gamma' \(callables there: alpha, beta\)"):
        resolve("fh_fns:gamma")
    with pytest.raises(ConfigError, match="expected a zoo model"):
        resolve("fh_fns")


def test_options_are_checked_against_the_signature_and_data_facts_passed():
    from hpctrain.errors import ConfigError
    from hpctrain.models.user import builder_kwargs

    def sized(input_shape, num_classes, width=8):
        pass

    def takes_all(depth, **rest):
        pass

    def needs_depth(depth, classes=2):
        pass

    cfg = {"name": "m:sized", "width": 4}
    assert builder_kwargs(sized, cfg, (20,), 3) == {
        "width": 4,
        "input_shape": (20,),
        "num_classes": 3,
    }
    with pytest.raises(ConfigError) as err:
        builder_kwargs(sized, {"name": "m:sized", "hidden": [64], "width": 2}, (20,), 3)
    assert "sized has no parameter for model.hidden (its parameters: input_shape, " in (
        str(err.value)
    )
    assert builder_kwargs(takes_all, {"name": "m:f", "depth": 2, "x": 1}, (4,), 2) == {
        "depth": 2,
        "x": 1,
    }
    with pytest.raises(ConfigError, match="needs depth and nothing supplies it: set model.depth"):
        builder_kwargs(needs_depth, {"name": "m:f"}, (4,), 2)
    # an explicit option wins over the data's fact (the checked forward pass judges it)
    assert builder_kwargs(needs_depth, {"name": "m:f", "depth": 1, "classes": 5}, (4,), 2) == {
        "depth": 1,
        "classes": 5,
    }


def test_a_keras_user_model_has_the_same_keys_however_many_models_the_process_built(
    monkeypatch,
):
    """Keras numbers unnamed layers per process (dense, dense_1, ...); the keys of a user
    model (and so its checkpoints) must not depend on what the process built before (a
    second Trainer in a notebook, a resumed run in the same process)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    from hpctrain.backends.tensorflow_user import build_user_model
    from hpctrain.models.zoo import InputSpec

    cfg = {"name": "random_layer_models:keras_dropout"}
    first = build_user_model(cfg, InputSpec((8,), 3), seed=0)
    second = build_user_model(cfg, InputSpec((8,), 3), seed=0)
    assert list(first.vars) == list(second.vars)
    assert list(second.vars)[0].startswith("dense/"), list(second.vars)


def test_a_module_that_exits_while_importing_is_a_configuration_error(tmp_path, monkeypatch):
    """A module that parses sys.argv at import (argparse) raised SystemExit through
    `hpctrain config` and the run: it is the model's problem, said in one line."""
    import sys

    from hpctrain.errors import ConfigError
    from hpctrain.models.user import resolve

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(2)\n")
    with pytest.raises(ConfigError, match="importing 'exits_on_import' raised"):
        resolve("exits_on_import:build")


def test_a_shared_library_missing_on_this_host_is_model_not_found(tmp_path, monkeypatch):
    """A module whose import needs a library a login node lacks (libcudart.so): the
    job's nodes may have it, so `hpctrain config` notes it; the run refuses it."""
    import sys

    from hpctrain.models.user import ModelNotFound, resolve

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "needs_cuda_lib.py").write_text(
        "raise ImportError('libcudart.so.13: cannot open shared object file')\n"
    )
    with pytest.raises(ModelNotFound, match="libcudart.so.13: cannot open .* on this host"):
        resolve("needs_cuda_lib:build")
