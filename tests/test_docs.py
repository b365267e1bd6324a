"""The README and the documentation site tell the truth the code can check.

The configuration page is generated from the schema and must be current; every key,
default and `--set` the pages quote must be one the schema accepts; every link must
resolve; `mkdocs build --strict` must pass; importing the configuration needs neither
MPI nor a framework (the generator runs without them).

And the classes of contradiction a reader found (issue 29): every subcommand and option
the CLI has is in a command table of the docs; every `hpctrain` command quoted in a
shell block parses with the real CLI, and every shell line of the README runs here or
sits in a block marked `<!-- illustrative: why -->`; limits.md states no limit the CLI
has lifted; the engine count, the pages of the index and the root options agree with
the code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
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
MAKEFILE = ROOT / "Makefile"
ILLUSTRATIVE = "<!-- illustrative"
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


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from hpctrain.cli import build_parser

    return build_parser()


def _parse(args: list[str]) -> str | None:
    """None when the real CLI accepts `hpctrain ARGS` (the command after `elastic --`
    too), else what argparse said."""
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = _parser().parse_args(args)
        except SystemExit as stop:
            return None if stop.code == 0 else out.getvalue().strip() or str(stop.code)
    if parsed.command == "elastic":
        inner = parsed.train[1:] if parsed.train[:1] == ["--"] else parsed.train
        if inner[:1] != ["train"]:
            return f"hpctrain elastic runs `-- train ...`, not {inner}"
        return _parse(inner)
    return None


def _hpctrain_args(words: list[str]) -> list[str] | None:
    """The arguments after the `hpctrain` word of a shell command, None without one."""
    tail = [i for i, w in enumerate(words) if Path(w).name == "hpctrain"]
    return words[tail[0] + 1 :] if tail else None


def _placeholder(command: str) -> bool:
    """A usage pattern (`[--opt]`, `a|b`, `...`, `<file>`), not a command to parse."""
    return any(s in command for s in ("[", "|", "...", "<", "{", "$("))


def test_commands_quote_real_subcommands_and_valid_overrides():
    commands = _parser()._subparsers._group_actions[0].choices
    for page in _pages():
        for block in _code_blocks(page.read_text()):
            for command in _commands(block):
                words = shlex.split(command)
                args = _hpctrain_args(words)
                if args is None:
                    continue
                if not args or args[0].startswith("-"):
                    continue
                assert args[0] in commands, f"{page.name}: {command}"
                if not _placeholder(command):
                    problem = _parse(args)
                    assert problem is None, f"{page.name}: {command}\n{problem}"
                overrides = [args[i + 1] for i, w in enumerate(args[:-1]) if w == "--set"]
                config = args[args.index("--config") + 1] if "--config" in args else None
                if args[0] in ("train", "ps", "config") and not (config or "").endswith("FILE"):
                    try:
                        Config.load(ROOT / config if config else None, overrides)
                    except ConfigError as err:
                        pytest.fail(f"{page.name}: {command}\n{err}")


# --- every subcommand and option in the docs' command tables ------------------------------

# The page whose tables document each command's options; getting-started.md's table
# lists every command. A new command must be given a page here.
OPTION_PAGES = {
    "doctor": "getting-started.md",
    "train": "getting-started.md",
    "ps": "getting-started.md",
    "config": "getting-started.md",
    "data": "getting-started.md",
    "slurm": "slurm.md",
    "ckpt": "checkpoints.md",
    "cluster": "cluster.md",
    "elastic": "elastic.md",
    "plan-memory": "large-models.md",
}
OVERVIEW = DOCS / "getting-started.md"


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every command the CLI runs, e.g. ("ckpt", "export")."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, (*path, name))


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        s
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction)
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    ]


def _table_rows(page: Path) -> list[str]:
    return [line for line in page.read_text().splitlines() if line.startswith("|")]


def _in_rows(rows: list[str], code: str) -> bool:
    """`code` opens a code span in a table row: `--opt`, `--opt ARG`, `--opt=...`."""
    pattern = re.compile(r"`" + re.escape(code) + r"[ `=]")
    return any(pattern.search(row) for row in rows)


def test_every_subcommand_is_in_the_command_table():
    commands = set(_parser()._subparsers._group_actions[0].choices)
    assert set(OPTION_PAGES) == commands, "give each new command its page in OPTION_PAGES"
    rows = _table_rows(OVERVIEW)
    missing = [
        " ".join(path)
        for path, _ in _leaves(_parser())
        if not _in_rows(rows, "hpctrain " + " ".join(path))
    ]
    assert not missing, f"not in the command table of {OVERVIEW.name}: {missing}"
    for option in _options(_parser()):  # --version
        assert _in_rows(rows, f"hpctrain {option}"), option


def test_every_option_of_every_subcommand_is_in_its_page_tables():
    missing = []
    for path, parser in _leaves(_parser()):
        page = DOCS / OPTION_PAGES[path[0]]
        rows = _table_rows(page)
        missing += [
            f"hpctrain {' '.join(path)} {option} ({page.name})"
            for option in _options(parser)
            if not _in_rows(rows, option)
        ]
    assert not missing, "options in no command table:\n" + "\n".join(missing)


# --- every shell line of the README runs, or is marked illustrative -----------------------


def _readme_blocks() -> list[tuple[bool, str]]:
    """(illustrative?, block) for each fenced shell block of the README: illustrative
    when the line before its fence is `<!-- illustrative: why -->`."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((before.startswith(ILLUSTRATIVE), match.group(1)))
    return blocks


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", MAKEFILE.read_text(), re.M))


def test_every_readme_shell_line_names_only_what_exists():
    """Marked or not: a make target the Makefile has, or an hpctrain command the CLI
    parses (subcommands, options; `--set` keys are checked above)."""
    targets = _make_targets()
    for _, block in _readme_blocks():
        for command in _commands(block):
            words = shlex.split(command)
            if words[0] == "make":
                assert words[1] in targets, f"README: {command}: no such make target"
                continue
            args = _hpctrain_args(words)
            assert args is not None, f"README: {command}: neither make nor hpctrain"
            problem = _parse(args)
            assert problem is None, f"README: {command}\n{problem}"


def test_every_unmarked_readme_shell_line_runs():
    runnable = [c for marked, block in _readme_blocks() if not marked for c in _commands(block)]
    assert runnable, "the README should show at least one command that runs as it is"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for command in runnable:
        first = shlex.split(command)[0]
        assert first not in ("make", "mpirun", "srun", "horovodrun", "sbatch"), (
            f"README: `{command}` is not cheap: mark its block {ILLUSTRATIVE}: why -->"
        )
        job = subprocess.run(
            command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert job.returncode == 0, f"README: `{command}` failed:\n{job.stderr}"


def test_the_demo_command_the_docs_quote_is_the_makefiles():
    recipe = re.search(r"^demo: .*\n\t(.*)$", MAKEFILE.read_text(), re.M).group(1)
    want = recipe.replace("$(VENV)", ".venv")
    for page in (README, DOCS / "getting-started.md"):
        quoted = re.search(r"`make demo` runs.*?```bash\n(.*?)\n```", page.read_text(), re.S)
        assert quoted and quoted.group(1).strip() == want, f"{page.name}: not `{want}`"


# --- limits, engines, index and root: no statement the code contradicts -------------------


def _refused(*overrides: str) -> bool:
    try:
        Config.load(None, list(overrides))
    except ConfigError:
        return True
    return False


def _choices(flag: str, *path: str) -> set:
    parser = dict(_leaves(_parser()))[path]
    return set(next(a for a in parser._actions if flag in a.option_strings).choices or ())


def _schema_choices(key: str) -> tuple:
    return _schema_default(key).choices


# (a phrase of limits.md, whether the limit it states still holds in the code): the phrase
# may stay only while it does. Phrases are matched with whitespace collapsed.
LIMITS = [
    ("there is no elastic training", lambda: "elastic" not in OPTION_PAGES),
    ("no elastic", lambda: "elastic" not in OPTION_PAGES),
    ("drives mpirun only", lambda: _choices("--launcher", "elastic") == {"mpirun"}),
    ("step per attempt is not built", lambda: "srun" not in _choices("--launcher", "elastic")),
    (
        "SLURM on loopback with one node.",
        lambda: "#SBATCH --nodes=2" not in (ROOT / "tests" / "test_multinode.py").read_text(),
    ),
    ("nothing here has been run on GPUs", lambda: "cuda" not in _schema_choices("runtime.device")),
    ("ZeRO stops at stage 2", lambda: max(_schema_choices("train.zero")) == 2),
    ("no ZeRO-3", lambda: 3 not in _schema_choices("train.zero")),
    (
        "bf16 (`train.precision`) runs with the data-parallel strategy only",
        lambda: _refused("strategy=pipeline", "train.precision=bf16"),
    ),
    (
        "bf16 (`train.precision`) runs with the data-parallel strategy and the torch "
        "backend's pipeline only",
        lambda: _refused("strategy=pipeline", "backend=tensorflow", "train.precision=bf16"),
    ),
    (
        "fp16 (dynamic loss scaling) runs with data parallelism only",
        lambda: _refused("strategy=pipeline", "train.precision=fp16"),
    ),
    (
        "Tensor parallelism splits the zoo transformer only",
        lambda: _refused("parallel.tensor=2", "model.name=mlp"),
    ),
    (
        "`train.compression` and `data.source: benchmark` are refused",
        lambda: _refused("strategy=parameter_server", "train.compression=topk"),
    ),
]


def test_limits_states_no_limit_the_cli_has_lifted():
    text = " ".join((DOCS / "limits.md").read_text().split())
    stale = [phrase for phrase, holds in LIMITS if phrase in text and not holds()]
    assert not stale, f"limits.md states limits the code no longer has: {stale}"


def test_the_engine_counts_and_tables_match_train_allreduce():
    engines = [c for c in _schema_choices("train.allreduce") if c != "auto"]
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight"]
    counted = r"\b(two|three|four|five|six|seven|eight) (?:gradient )?engines\b"
    for page in _pages():
        text = " ".join(page.read_text().split())
        for said in re.findall(counted, text):
            assert words.index(said) == len(engines), (
                f"{page.name} says {said} engines; train.allreduce has {len(engines)}: {engines}"
            )
    rows = _table_rows(DOCS / "gradient-engines.md")
    for engine in [*engines, "auto"]:
        assert any(row.startswith(f"| `{engine}`") for row in rows), engine


def test_the_index_and_the_readme_link_every_page_of_the_site():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(items):
        for item in items:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    index = (DOCS / "index.md").read_text()
    readme = README.read_text()
    for page in pages(nav):
        if page == "index.md":
            continue
        assert f"]({page}" in index, f"docs/index.md does not link {page}"
        assert f"](docs/{page}" in readme, f"README.md does not link docs/{page}"


def test_the_slurm_template_tables_say_what_each_template_runs():
    """docs/slurm.md and slurm/README.md: each template's row names the hpctrain command
    its script runs, and a strategy a row requires is one hpctrain has."""
    from hpctrain.strategies import STRATEGIES

    templates = ROOT / "hpctrain" / "slurm" / "templates"
    runs = {
        p.stem: re.search(r'"\$HPCTRAIN" (\w+)', p.read_text()).group(1)
        for p in templates.glob("*.sbatch")
    }
    for page in (DOCS / "slurm.md", ROOT / "slurm" / "README.md"):
        rows = {}
        for row in _table_rows(page):
            for name in re.findall(r"`(\w+)(?:\.sbatch)?`", row.split("|")[1]):
                rows[name] = row.split("|")[2]
        for name, command in runs.items():
            assert name in rows, f"{page.name}: no row for the {name} template"
            said = re.findall(r"`hpctrain (\w+)", rows[name])
            assert said == [command], f"{page.name}: {name} runs hpctrain {command}, not {said}"
            for named in re.findall(r"`strategy` is ((?:`\w+`(?: / |, | or )?)+)", rows[name]):
                for strategy in re.findall(r"`(\w+)`", named):
                    assert strategy in STRATEGIES, f"{page.name}: no strategy {strategy!r}"


def test_the_readme_names_every_way_to_run_mpirun_as_root_the_cli_and_makefile_use():
    from hpctrain.cli import LAUNCH_HELP

    readme = README.read_text()
    for way in ("--allow-run-as-root", "OMPI_ALLOW_RUN_AS_ROOT"):
        if way in LAUNCH_HELP or way in MAKEFILE.read_text():
            assert way in readme, f"hpctrain --help or the Makefile says {way}; README does not"


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
    # the newest complete run; a report of some sections (`--sections`) is named
    # <UTC>-<what> and quoted where its figures are
    committed = sorted(
        p.parent.name for p in reference.glob("*/results.json") if "-" not in p.parent.name
    )
    for name in re.findall(r"benchmarks/reference/([0-9TZ]+(?:-[a-z0-9-]+)?)", text):
        assert (reference / name / "results.json").exists(), name
    if committed:  # the committed reference report replaces the session-2 figures
        assert committed[-1] in text, f"docs/benchmarks.md does not quote {committed[-1]}"
        assert "not in the repository" not in text
    else:
        assert "20261121T022316Z (not in the repository)" in text
