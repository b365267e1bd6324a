"""The step is written once (backends/step.py): both backends provide its primitives and
keep no step sequence of their own."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from hpctrain.backends.step import StepPrimitives

BACKENDS = Path(__file__).resolve().parent.parent / "hpctrain" / "backends"


def _primitive_names() -> list[str]:
    return [
        n
        for n, v in vars(StepPrimitives).items()
        if inspect.isfunction(v) and not n.startswith("_")
    ]


@pytest.mark.parametrize("name", ["torch", "tensorflow"])
def test_each_backend_provides_every_primitive(name):
    from hpctrain.backends import backend_class

    cls = backend_class(name)
    missing = [m for m in _primitive_names() if not callable(getattr(cls, m, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("module", ["torch.py", "tensorflow.py"])
def test_train_step_only_hands_over_to_the_shared_sequence(module):
    """A backend's train_step is one call of step.train_step (no second copy)."""
    tree = ast.parse((BACKENDS / module).read_text())
    steps = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step"]
    assert len(steps) == 1
    body = [s for s in steps[0].body if not isinstance(s, ast.Expr)]  # docstring aside
    assert len(body) == 1 and "step.train_step" in ast.unparse(body[0])
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not names & {"_zero_step", "_tensor_split_mask"}
