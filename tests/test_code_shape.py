"""The code-shape targets of issue 26, kept: no function in hpctrain/ over 80 lines and no
backend module over 450 lines. A step that grows past them is the sign of two jobs in one
(or of a framework's code written twice), and a target only a reviewer checks drifts."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpctrain"
MAX_FUNCTION_LINES = 80
MAX_BACKEND_LINES = 450


def long_functions(root: Path, limit: int) -> list[str]:
    """'path:line name (N lines)' for every function or method over `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({lines} lines)")
    return found


def long_modules(directory: Path, limit: int) -> list[str]:
    """'path (N lines)' for every module in `directory` over `limit` lines."""
    sizes = {p: len(p.read_text().splitlines()) for p in sorted(directory.glob("*.py"))}
    return [f"{p.relative_to(directory.parent)} ({n} lines)" for p, n in sizes.items() if n > limit]


def test_no_function_in_hpctrain_is_over_80_lines():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_no_backend_module_is_over_450_lines():
    assert long_modules(PACKAGE / "backends", MAX_BACKEND_LINES) == []


def test_the_checks_find_what_is_over(tmp_path):
    limit = 10
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(limit))
    (package / "mod.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(package, limit) == [f"pkg/mod.py:5 long ({limit + 1} lines)"]
    assert long_modules(package, limit + 4) == [f"pkg/mod.py ({limit + 5} lines)"]
    assert long_modules(package, limit + 5) == []
