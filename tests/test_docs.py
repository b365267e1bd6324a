"""The README and the documentation site tell the truth the code can check.

The configuration page is generated from the schema and must be current; every key,
default and `--set` the pages quote must be one the schema accepts; every link must
resolve; `mkdocs build --strict` must pass; importing the configuration needs neither
MPI nor a framework (the generator runs without them).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hpctrain.config import SCHEMA, Config, describe_schema
from hpctrain.errors import ConfigError
from hpctrain.moe.options import MOE_DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = DOCS / "reference" / "configuration.md"
GENERATOR = ROOT / "tools" / "gen_config_docs.py"
MKDOCS = Path(sys.executable).parent / "mkdocs"
README = ROOT / "README.md"
# Hand-written pages whose tables name keys without their section prefix.
TABLE_PREFIX = {"moe.md": "model.moe.", "checkpoint-format.md": "checkpoint."}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """Shell commands of a code block, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip()]


def test_the_configuration_page_is_current():
    job = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60
    )
    assert job.returncode == 0, job.stderr


def test_the_configuration_page_lists_every_key_with_its_default():
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", GENERATED.read_text(), re.M))
    for key, default, _ in describe_schema():
        assert rows.get(key) == default.replace("|", "\\|"), key
    for key, default in MOE_DEFAULTS.items():
        assert yaml.safe_load(rows[f"model.moe.{key}"]) == default, key


def test_the_generator_needs_neither_mpi_nor_a_framework(tmp_path):
    out = tmp_path / "configuration.md"
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["gen_config_docs.py", "--output", {str(out)!r}]
        try:
            runpy.run_path({str(GENERATOR)!r}, run_name="__main__")
        except SystemExit as stop:
            assert not stop.code, stop.code
        frameworks = ("mpi4py", "torch", "tensorflow", "keras", "horovod")
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in frameworks)
        assert not heavy, heavy
    """)
    job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    assert out.read_text() == GENERATED.read_text()


def _schema_default(key: str):
    spec = SCHEMA
    for part in key.split("."):
        if not isinstance(spec, dict) or part not in spec:
            return None
        spec = spec[part]
    return spec


@pytest.mark.parametrize("page", [p.name for p in _pages() if p != GENERATED], ids=str)
def test_hand_written_tables_quote_the_schema_defaults(page):
    path = README if page == README.name else next(DOCS.rglob(page))
    prefix = TABLE_PREFIX.get(page, "")
    for key, shown in re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)`", path.read_text(), re.M):
        full = key if "." in key else prefix + key
        if full.startswith("model.moe."):
            want = MOE_DEFAULTS.get(full.removeprefix("model.moe."), KeyError)
        else:
            spec = _schema_default(full)
            want = getattr(spec, "default", KeyError)
        if want is KeyError:
            continue  # not a key table row (e.g. a template or a metric name)
        assert yaml.safe_load(shown) == want, f"{page}: `{full}` shown as {shown}, is {want!r}"


def test_every_relative_link_resolves():
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"


def test_commands_quote_real_subcommands_and_valid_overrides():
    from hpctrain.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for page in _pages():
        for block in _code_blocks(page.read_text()):
            for command in _commands(block):
                words = shlex.split(command)
                tail = [w for w in words if "hpctrain" in Path(w).name]
                if not tail:
                    continue
                args = words[words.index(tail[0]) + 1 :]
                if not args or args[0].startswith("-"):
                    continue
                assert args[0] in commands, f"{page.name}: {command}"
                overrides = [args[i + 1] for i, w in enumerate(args[:-1]) if w == "--set"]
                config = args[args.index("--config") + 1] if "--config" in args else None
                if args[0] in ("train", "ps", "config") and not (config or "").endswith("FILE"):
                    try:
                        Config.load(ROOT / config if config else None, overrides)
                    except ConfigError as err:
                        pytest.fail(f"{page.name}: {command}\n{err}")


def test_the_readme_stays_short_and_keeps_the_test_command():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert "make test" in text


def test_the_site_builds_without_warnings(tmp_path):
    job = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


def test_benchmark_figures_name_a_report_that_exists():
    text = " ".join((DOCS / "benchmarks.md").read_text().split())
    reference = ROOT / "benchmarks" / "reference"
    committed = sorted(p.parent.name for p in reference.glob("*/results.json"))
    for name in re.findall(r"benchmarks/reference/([0-9TZ]+)", text):
        assert (reference / name / "results.json").exists(), name
    if committed:  # the committed reference report replaces the session-2 figures
        assert committed[-1] in text, f"docs/benchmarks.md does not quote {committed[-1]}"
        assert "not in the repository" not in text
    else:
        assert "20261121T022316Z (not in the repository)" in text
