"""The environment variables hpctrain reads are the ones docs/environment.md lists, none
shadows a configuration key, and product code reaches no test code (faults come in as
a `Faults` object, runtime/faults.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hpctrain.runtime.faults import PREFIX, Faults, fault_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hpctrain"
PAGE = ROOT / "docs" / "environment.md"
NAME = re.compile(r"HPCTRAIN_[A-Z0-9_]*[A-Z0-9]_?")
# settings that are configuration keys now, never read from the environment again
REPLACED = {
    "HPCTRAIN_STALL_WARNING": "runtime.stall_warning",
    "HPCTRAIN_COLLECTIVE_TIMEOUT": "runtime.collective_timeout",
    "HPCTRAIN_MAX_REQUEUES": "runtime.max_requeues",
}


def _product_files():
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path


def _named_in_product() -> dict[str, str]:
    found = {}
    for path in _product_files():
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def _documented() -> set[str]:
    table = PAGE.read_text().split("## Used by the test suite")[0]
    return {m.replace("<NAME>", "") for m in re.findall(r"`(HPCTRAIN_[A-Z_<>]*)`", table)}


def test_every_hpctrain_variable_in_the_package_is_on_the_environment_page():
    documented = _documented()
    assert "HPCTRAIN_THREADS" in documented and PREFIX in documented
    missing = {
        name: where
        for name, where in _named_in_product().items()
        if name not in documented and not (name.startswith(PREFIX) and PREFIX in documented)
    }
    assert not missing, f"not listed in docs/environment.md: {missing}"


def test_no_variable_shadows_a_configuration_key():
    named = _named_in_product()
    assert not {k: named[k] for k in REPLACED if k in named}
    from hpctrain import Config

    cfg = Config.load(None, [f"{key}=7" for key in REPLACED.values()])
    assert all(key.startswith("runtime.") for key in REPLACED.values())
    assert [cfg.runtime[key[len("runtime.") :]] for key in REPLACED.values()] == [7, 7, 7]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return out


def test_product_code_imports_no_test_module():
    offenders = {}
    for path in _product_files():
        if path.suffix != ".py":
            continue
        bad = [
            m
            for m in _imports(path)
            if m.split(".")[0] in ("tests", "conftest", "pytest") or "testing" in m.split(".")[1:]
        ]
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, offenders
    assert not (PACKAGE / "testing").exists(), "test support belongs in tests/, not hpctrain/"


def test_faults_are_off_by_default_and_read_only_from_their_variables():
    none = Faults.none()
    assert none == Faults() and all(getattr(none, n) is None for n in Faults.names())
    assert none.value("die_at_step", 0) is None and none.kill_after_datasets() is None
    none.after_step(0, 1)  # no-op
    env = {**fault_env("die_at_step", 1, 8), **fault_env("copy_delay", 0, 0.3), "OTHER": "x"}
    assert env["HPCTRAIN_FAULT_DIE_AT_STEP"] == "1:8"
    faults = Faults.from_env(env)
    assert faults == Faults(die_at_step=(1, 8.0), copy_delay=(0, 0.3))
    assert faults.value("die_at_step", 1) == 8.0 and faults.value("die_at_step", 0) is None
    assert Faults.from_env({}) is Faults.none()
    with pytest.raises(ValueError, match="unknown fault"):
        fault_env("no_such_fault", 0, 1)
