"""No module-level communicator state in hpctrain (issue 26: groups live on the grid).

Every communicator (the World's axes, the tensor group, the expert group) is made from
the process grid and handed to whoever uses it through constructors. A module that
keeps one in a global reaches around that: a second run in the same process would use
the first run's group, and a caller that forgot to place one would silently get the
whole job. This walks every module of hpctrain with `ast` and fails on

- a `global` statement (in any function) rebinding a communicator-like name, and
- a module-level variable with a communicator-like name bound to anything but a
  constant (a mutable holder such as `_group: TensorGroup | None = None` included).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hpctrain"

# Words of a name (snake_case parts) that say it holds or wraps a communicator.
COMMUNICATOR_WORDS = frozenset(
    {"group", "groups", "comm", "comms", "world", "axis", "axes", "grid", "mesh", "pg"}
    | {"watchdog", "processset", "process_set"}
)


def communicator_like(name: str) -> bool:
    words = name.lower().strip("_").split("_")
    pairs = {f"{a}_{b}" for a, b in zip(words, words[1:])}
    return bool(COMMUNICATOR_WORDS & (set(words) | pairs))


# module -> {name: reason}: the only module-level communicator state allowed.
EXCEPTIONS = {
    "runtime/world.py": {
        "_world": "the World wraps MPI.COMM_WORLD, which MPI itself makes once per "
        "process; every other communicator is split from it by the grid",
        "_world_lock": "guards the creation of that one World (threads may ask for it)",
    },
}


def _modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _allowed(path: Path, name: str) -> bool:
    return name in EXCEPTIONS.get(path.relative_to(ROOT).as_posix(), {})


def _global_rebinds(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield from ((node.lineno, n) for n in node.names)


def _module_level_bindings(tree: ast.Module):
    """(line, name, value) of assignments directly in the module body."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield node.lineno, target.id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.lineno, node.target.id, node.value


def _is_constant(value) -> bool:
    """Literals and tuples/frozensets of them: not state, whatever the name."""
    if value is None:
        return False
    if isinstance(value, ast.Constant):
        return value.value is not None  # `x = None` is a holder waiting to be set
    if isinstance(value, ast.Tuple):
        return all(_is_constant(e) for e in value.elts)
    return isinstance(value, ast.Call) and getattr(value.func, "id", "") == "frozenset"


def test_no_module_level_communicator_state():
    problems = []
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ROOT).as_posix()
        for line, name in _global_rebinds(tree):
            if communicator_like(name) and not _allowed(path, name):
                problems.append(f"{rel}:{line}: `global {name}` keeps a communicator")
        for line, name, value in _module_level_bindings(tree):
            if name.isupper() and _is_constant(value):
                continue  # a named constant (AXES = ("data", ...), GROUP = "hpctrain")
            if communicator_like(name) and not _allowed(path, name) and not _is_constant(value):
                problems.append(f"{rel}:{line}: module-level `{name}` holds group state")
    assert not problems, "\n".join(problems)


def test_the_exceptions_still_exist():
    """An exception whose variable is gone is removed from the list (kept precise)."""
    for rel, names in EXCEPTIONS.items():
        source = (ROOT / rel).read_text()
        for name in names:
            assert re.search(rf"^{name}\b|global {name}\b", source, re.MULTILINE), (rel, name)


def test_the_checker_sees_a_module_global_group():
    """The walk catches both forms it looks for (a planted example, not hpctrain)."""
    tree = ast.parse(
        "_group: TensorGroup | None = None\n"
        "def use_axis(axis):\n"
        "    global _group\n"
        "    _group = TensorGroup(axis)\n"
    )
    assert [n for _, n in _global_rebinds(tree)] == ["_group"]
    assert not communicator_like("COMMANDS") and communicator_like("_expert_group")
    bound = [(n, _is_constant(v)) for _, n, v in _module_level_bindings(tree)]
    assert bound == [("_group", False)] and communicator_like("_group")
