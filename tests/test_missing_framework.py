"""A framework that is not installed is named in one line, before any work: setup.cfg's
extras allow a torch-only or TensorFlow-only install, and each such path ended in a
ModuleNotFoundError traceback (train with the other backend after the data was made,
`ckpt export --to keras-model`, and `hpctrain doctor` itself)."""

import importlib
import importlib.util

import pytest

from hpctrain.backends import framework_problem, load_backend
from hpctrain.errors import ConfigError


@pytest.fixture
def without_tensorflow(monkeypatch):
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find_spec(name, *args):
        return None if name == "tensorflow" else real_find(name, *args)

    def import_module(name, *args):
        if "tensorflow" in name:
            raise ModuleNotFoundError("No module named 'tensorflow'")
        return real_import(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib, "import_module", import_module)


def test_the_problem_names_the_framework_the_python_and_the_way_out(without_tensorflow):
    assert framework_problem("torch") is None
    problem = framework_problem("tensorflow")
    assert problem.startswith("backend tensorflow: tensorflow is not installed for ")
    assert "pip install 'hpctrain[tensorflow]'" in problem and "other backend" in problem
    with pytest.raises(ConfigError, match="backend tensorflow: tensorflow is not installed"):
        load_backend("tensorflow")


def test_train_with_a_missing_framework_is_one_line_before_the_run_directory(
    without_tensorflow, tmp_path, capsys
):
    from hpctrain.cli import main

    run = tmp_path / "run"
    code = main(["train", "--run-dir", str(run), "--set", "backend=tensorflow"])
    err = capsys.readouterr().err
    assert code == 2 and "backend tensorflow: tensorflow is not installed" in err, err
    assert "Traceback" not in err and not run.exists()


def test_doctor_names_a_missing_framework_instead_of_crashing(without_tensorflow):
    from hpctrain import doctor

    rows, missing = doctor._check_backend("tensorflow")
    assert missing == ["tensorflow"] and rows[0][1].startswith("MISSING (ModuleNotFoundError")


def test_a_keras_export_without_tensorflow_is_refused_in_one_line(without_tensorflow, tmp_path):
    from hpctrain.backends.export import write_keras_model

    with pytest.raises(ConfigError, match="--to keras-model needs tensorflow: tensorflow is"):
        write_keras_model({}, tmp_path / "m.keras", None)


def test_train_without_tensorboard_is_one_line_before_the_run_directory(
    monkeypatch, tmp_path, capsys
):
    """metrics.tensorboard is on by default and tensorboard is not among the package's
    requirements: a Python without it (the GPU machine's was one) ended every run in a
    ModuleNotFoundError traceback, after the run directory and metrics.jsonl existed."""
    from hpctrain.cli import main

    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real_find(name, *a),
    )
    run = tmp_path / "run"
    code = main(["train", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "metrics.tensorboard=true (the default) needs the tensorboard" in err
    assert "Traceback" not in err and not run.exists(), err
