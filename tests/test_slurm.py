"""hpctrain on a real (one-node, loopback) SLURM: sbatch templates, srun rank mapping,
requeue, and the renderer's validation.

Rendering tests need no SLURM. The others use the `slurm` fixture (tests/slurm_cluster.py),
which starts munged/slurmctld/slurmd and is skipped, saying why, if it cannot.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from mpirun import HPCTRAIN, PYTHON
from slurm_cluster import TERMINAL_STATES, SlurmUnavailable, start_cluster

from hpctrain import config as config_module
from hpctrain import run_marker
from hpctrain.errors import ConfigError
from hpctrain.runtime.launcher import launcher_views
from hpctrain.slurm import gpus, templates
from hpctrain.slurm.templates import (
    JobSpec,
    memory_size,
    parse_time,
    render,
    sweep_points,
    template_names,
)

MOE_MODEL = ["model.name=transformer", "data.task=tokens", "model.moe={experts: 8}"]
TINY = ["--set", "train.epochs=1", "--set", "data.train_samples=1024"]
TINY += ["--set", "data.val_samples=256", "--set", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, request):
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        message = f"SLURM tests skipped: cannot start a test cluster: {exc}"
        # Said on the terminal at once (not only in -rs summaries): `make test` runs -q.
        plugins = request.config.pluginmanager
        reporter = plugins.get_plugin("terminalreporter")
        capture = plugins.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\n{message}", yellow=True, bold=True)
        pytest.skip(message)
    yield cluster
    cluster.stop()


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("model:\n  name: mlp\ntrain:\n  batch_size: 32\n")
    return path


_CLI: ForkedCli | None = None  # the server of hpctrain()'s forked calls


def hpctrain(*args: str, cwd=None, env=None, timeout: float = 60):
    """`hpctrain ARGS` as its own process: exit code, stdout and stderr. Without `cwd` or
    `env` (the renderer's and validation's calls, about a hundred) the process is forked
    from a server that imported the CLI once (tests/forked_cli.py): the same clean start,
    without half a second of interpreter start per call."""
    global _CLI
    if cwd is None and env is None:
        if _CLI is None or not _CLI.alive():  # first call, or a call that timed out
            _CLI = ForkedCli()
            atexit.register(_CLI.close)
        return _CLI.run([HPCTRAIN, *args], timeout=timeout)
    return subprocess.run(
        [HPCTRAIN, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def render_args(name: str, config: Path, *extra: str) -> list[str]:
    return [
        "slurm",
        "render",
        name,
        "--nodes",
        "2",
        "--ntasks-per-node",
        "4",
        "--cpus-per-task",
        "3",
        "--time",
        "1-02:00:00",
        "--config",
        str(config),
        *extra,
    ]


# --- rendering (no SLURM needed) ---------------------------------------------------------


def _strategy_supported(name: str) -> bool:
    meta = templates.template_meta(templates.find_template(name).read_text())
    choices = config_module.SCHEMA["strategy"].choices
    return all(s in choices for s in meta.get("strategy", []))


@pytest.mark.parametrize("name", template_names())
def test_every_template_renders_to_valid_bash(name, config_file, tmp_path, monkeypatch):
    meta = templates.template_meta(templates.find_template(name).read_text())
    if _strategy_supported(name):
        sets = [f"strategy={s}" for s in meta.get("strategy", [])]
    else:
        # The config schema does not know this template's strategy yet: check the
        # script itself, without validating the config against it.
        monkeypatch.setattr(templates, "_check_config", lambda spec, m, t: Path(spec.config))
        sets = []
    spec = JobSpec(name, 2, 4, "1-02:00:00", str(config_file), cpus_per_task=3)
    spec.overrides = sets + ["train.batch_size=16"]
    if "moe" in meta.get("needs", []):  # a mixture-of-experts model, 8 experts on 8 ranks
        spec.overrides += MOE_MODEL
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render(spec).text)
    text = script.read_text()
    assert not re.search(r"\{\{\s*\w+\s*\}\}", text)
    for directive in (
        "--nodes=2",
        "--ntasks-per-node=4",
        "--cpus-per-task=3",
        "--time=1-02:00:00",
        "--signal=USR1@90",
        "--requeue",
        "--open-mode=append",
    ):
        assert f"#SBATCH {directive}\n" in text, directive
    assert re.search(r"^#SBATCH --output=\./%x-%(j|A_%a)\.out$", text, re.M)
    assert "--gres" not in text and "--partition" not in text  # only when asked
    if name == "elastic":  # the supervisor runs srun, with the script's srun options
        assert '"$HPCTRAIN" elastic --launcher srun --launcher-args=' in text
        assert '    --mpi="$MPI_PLUGIN"\n' in text and "#SBATCH --no-kill\n" in text
    else:
        assert 'srun --mpi="$MPI_PLUGIN"' in text
    assert "MPI_PLUGIN=${MPI_PLUGIN:-pmix}" in text
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in text
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in text
    assert "# module load" in text and "HPCTRAIN_EXTRA_ARGS" in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"\b(mpirun|mpiexec|ssh|horovodrun)\b", line)]
    assert "--set train.batch_size=16" in text
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(
            ["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60
        )
        assert lint.returncode == 0, lint.stdout


def test_repo_slurm_dir_links_to_the_packaged_templates():
    repo_dir = Path(__file__).resolve().parents[1] / "slurm"
    linked = sorted(p.name for p in repo_dir.glob("*.sbatch"))
    assert linked == [f"{name}.sbatch" for name in template_names()]
    for name in linked:
        assert (repo_dir / name).resolve() == templates.TEMPLATE_DIR / name  # one copy


def test_render_cli_writes_an_executable_script_with_gpus_and_partition(config_file, tmp_path):
    out = tmp_path / "job.sbatch"
    args = render_args("train", config_file, "--gpus-per-node", "4", "--partition", "gpu")
    args += ["--hpctrain", "/opt/gpu-venv/bin/hpctrain"]  # a GPU install, not this one
    result = hpctrain(*args, "--mpi", "pmi2", "--job-name", "resnet", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out} (time limit 1 d 2 h;" in result.stdout
    usable, found = gpus.install_gpu_support("torch")
    assert ("the job runs /opt/gpu-venv/bin/hpctrain" in result.stderr) is not usable, (
        found,
        result.stderr,
    )
    assert out.stat().st_mode & 0o111 == 0o111
    text = out.read_text()
    assert "#SBATCH --gres=gpu:4\n" in text and "#SBATCH --partition=gpu\n" in text
    assert "#SBATCH --job-name=resnet\n" in text and "MPI_PLUGIN=${MPI_PLUGIN:-pmi2}" in text
    assert f"--config {config_file.resolve()}" in text
    assert "# rendered by: hpctrain slurm render train --nodes 2" in text
    printed = hpctrain(*render_args("train", config_file))
    assert printed.returncode == 0 and printed.stdout.startswith("#!/bin/bash\n")


def test_render_says_when_it_replaced_a_script_and_how_to_create_the_log_dir(config_file, tmp_path):
    """`render -o` over an existing script says it replaced it; a --log-dir that does not
    exist is in the advice (SLURM does not create it: the job could not open its output)."""
    out, logs = tmp_path / "job.sbatch", tmp_path / "logs"
    args = render_args("train", config_file, "--log-dir", str(logs), "-o", str(out))
    first = hpctrain(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"wrote {out} (time limit 1 d 2 h;"), first.stdout
    assert first.stdout.endswith(f"submit with: mkdir -p {logs} && sbatch {out})\n")
    assert not logs.exists()  # render writes only the script
    rendered = out.read_text()
    out.write_text(rendered + "# edited by hand\n")  # edits: render would lose them
    refused = hpctrain(*args)
    assert refused.returncode == 2 and "was edited since" in refused.stderr, refused.stderr
    assert out.read_text().endswith("# edited by hand\n")
    out.write_text(rendered)  # as rendered: re-rendering replaces it
    logs.mkdir()
    second = hpctrain(*args)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith(f"replaced {out} (time limit 1 d 2 h;"), second.stdout
    assert second.stdout.endswith(f"submit with: sbatch {out})\n"), second.stdout
    assert out.read_text().startswith("#!/bin/bash\n")
    # printed and saved by the shell, then edited: kept too (it had no digest line)
    printed = hpctrain(*render_args("train", config_file, "--log-dir", str(logs)))
    out.write_text(printed.stdout + "# edited by hand\n")
    refused = hpctrain(*args)
    assert refused.returncode == 2 and "was edited since" in refused.stderr, refused.stderr
    out.write_text(printed.stdout)
    assert hpctrain(*args).returncode == 0
    # any other file is not -o's to replace: the config itself, a hand-written script
    for theirs in (Path(config_file), tmp_path / "mine.sbatch"):
        if not theirs.exists():
            theirs.write_text("#!/bin/bash\n#SBATCH --nodes=1\nsrun hostname\n")
        before = theirs.read_text()
        args = render_args("train", config_file, "--log-dir", str(logs), "-o", str(theirs))
        refused = hpctrain(*args)
        assert refused.returncode == 2, refused.stderr
        assert "is not a script `hpctrain slurm render` wrote" in refused.stderr
        assert theirs.read_text() == before


SITE_OPTIONS = [
    "--account",
    "proj42",
    "--qos",
    "high",
    "--mem",
    "64G",
    "--exclusive",
    "--constraint",
    "a100&ib",
    "--sbatch-line=--mail-type=END",
    "--sbatch-line",
    "#SBATCH --mail-user=me@example.org",
]


@pytest.mark.parametrize("name", ["train", "pipeline", "ps", "moe", "sweep", "elastic"])
def test_site_options_become_sbatch_directives_in_every_template(name, config_file, tmp_path):
    sets = {"pipeline": ["strategy=pipeline"], "moe": MOE_MODEL}.get(name, [])
    args = render_args(name, config_file, *SITE_OPTIONS)
    for s in sets:
        args += ["--set", s]
    out = tmp_path / f"{name}.sbatch"
    result = hpctrain(*args, "-o", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    for directive in (
        "--account=proj42",
        "--qos=high",
        "--mem=64G",
        "--exclusive",
        "--constraint=a100&ib",
        "--mail-type=END",
        "--mail-user=me@example.org",
    ):
        assert f"\n#SBATCH {directive}\n" in text, directive
    # every directive comes before the first command, or sbatch ignores it
    first_command = next(
        i for i, line in enumerate(text.splitlines()[1:], 1) if line and not line.startswith("#")
    )
    assert max(i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH")) < (
        first_command
    )
    recorded = next(line for line in text.splitlines() if line.startswith("# rendered by:"))
    assert "--exclusive" in recorded and "--account proj42" in recorded
    check = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", str(out)], capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout
    if name in ("train", "pipeline", "ps"):
        assert "--mem-per-cpu" not in text  # only what was asked for


@pytest.mark.parametrize(
    "change, message",
    [
        (["--mem", "64GB"], "--mem '64GB': expected a size like 64G"),
        (["--mem", "8G", "--mem-per-cpu", "2G"], "--mem and --mem-per-cpu exclude each other"),
        (["--account", "my account"], "--account 'my account'"),
        (["--constraint", "a100 ib"], "--constraint 'a100 ib'"),
        (["--sbatch-line=--time=5"], "the template sets --time itself; use --time instead"),
        (["--sbatch-line", "-N 4"], "the template sets --nodes itself"),
        (["--sbatch-line=--signal=B:USR1@60"], "the template sets --signal itself"),
        (["--sbatch-line=mail-type=END"], "expected one sbatch option"),
    ],
)
def test_site_options_are_checked(change, message, config_file):
    result = hpctrain(*render_args("train", config_file, *change))
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "template, sets, nodes, per_node, message",
    [
        ("pipeline", ["strategy=pipeline"], 1, 3, "pipeline.stages=2 needs a multiple of 2"),
        ("pipeline", ["strategy=pipeline", "pipeline.stages=3"], 1, 1, "gives 1"),
        ("ps", ["ps.servers=2"], 1, 2, "ps.servers=2 leaves no worker"),
        ("moe", [], 1, 2, "has no model.moe: use the train template"),
        ("moe", MOE_MODEL[:2] + ["model.moe={experts: 4}"], 1, 3, "cannot be split evenly"),
        ("train", MOE_MODEL[:2] + ["model.moe={experts: 4}"], 2, 4, "over 8 expert-parallel"),
        (
            "train",
            MOE_MODEL[:2] + ["model.moe={experts: 4}", "parallel.expert=3"],
            1,
            4,
            "parallel.expert=3 does not divide the 4 ranks",
        ),
        ("sweep", ["strategy=pipeline"], 1, 4, "sweep point 0 (1 rank(s) on 1 node(s))"),
        (
            "train",
            ["data.train_samples=100", "train.batch_size=16"],
            2,
            4,
            "data.train_samples: 100 training samples do not fill one global batch of 128 "
            "(train.batch_size 16 x train.grad_accum 1 x 8 data-parallel replica(s)) at "
            "--nodes 2 x --ntasks-per-node 4",
        ),
        (
            "pipeline",
            ["strategy=pipeline", "data.train_samples=100", "train.batch_size=16"],
            1,
            4,
            "global batch of 128 (train.batch_size 16 x pipeline.microbatches 4 x 2 data",
        ),
    ],
)
def test_render_refuses_world_sizes_the_config_cannot_run(
    template, sets, nodes, per_node, message, config_file
):
    args = ["slurm", "render", template, "--nodes", str(nodes), "--ntasks-per-node"]
    args += [str(per_node), "--time", "10", "--config", str(config_file)]
    for s in sets:
        args += ["--set", s]
    result = hpctrain(*args)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_render_checks_an_hdf5_training_split_it_can_open(config_file, tmp_path):
    """A file this machine can open is checked before the job queues (its metadata, with
    the validation rows held out); one it cannot see is left to the job's own check."""
    import h5py
    import numpy as np

    path = tmp_path / "small.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((100, 8), np.float32)
        f["y"] = np.zeros(100, np.int64)
    args = ["slurm", "render", "train", "--nodes", "2", "--ntasks-per-node", "2", "--time"]
    args += ["10", "--config", str(config_file), "--set", "data.source=hdf5"]
    args += ["--set", "train.batch_size=32", "--set"]
    result = hpctrain(*args, f"data.path={path}")
    assert result.returncode == 2, result.stdout
    assert f"{path}: 90 training samples do not fill one global batch of 128" in result.stderr
    result = hpctrain(*args, f"data.path={tmp_path / 'on-the-cluster-only.h5'}")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("template", ["train", "pipeline", "ps", "moe", "elastic"])
@pytest.mark.parametrize(
    "extra, expected",
    [
        ("", ["--resume", "auto"]),
        ("--verbose", ["--resume", "auto", "--verbose"]),
        (
            "--verbose --set train.epochs=3",
            ["--resume", "auto", "--verbose", "--set", "train.epochs=3"],
        ),
        ("--resume runs/x/ckpt.h5", ["--resume", "auto", "--resume", "runs/x/ckpt.h5"]),
    ],
)
def test_templates_keep_resume_auto_whatever_the_extra_arguments(
    template, extra, expected, config_file, tmp_path
):
    """The script's own bash decides the train command line: run it with an `srun` that
    prints its arguments (argparse takes the last --resume, so FILE still wins)."""
    sets = {"pipeline": ["strategy=pipeline"], "moe": MOE_MODEL}.get(template, [])
    args = ["slurm", "render", template, "--nodes", "1", "--ntasks-per-node", "2", "--time", "10"]
    args += ["--config", str(config_file), "--hpctrain", "hpctrain"]
    if template == "moe":
        sets = [*MOE_MODEL[:2], "model.moe={experts: 2}"]
    for s in sets:
        args += ["--set", s]
    script = tmp_path / "job.sbatch"
    assert hpctrain(*args, "-o", str(script)).returncode == 0
    shim = tmp_path / "bin"
    shim.mkdir()
    for fake in ("srun", "hpctrain"):  # hpctrain: the elastic template runs it
        (shim / fake).write_text('#!/bin/bash\nfor a in "$@"; do echo "ARG $a"; done\n')
        (shim / fake).chmod(0o755)
    env = {
        "PATH": f"{shim}:/usr/bin:/bin",
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "2",
        "SLURM_CPUS_PER_TASK": "1",
        "HPCTRAIN_EXTRA_ARGS": extra,
    }
    run = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30
    )
    assert run.returncode == 0, run.stderr
    argv = [line[4:] for line in run.stdout.splitlines() if line.startswith("ARG ")]
    after_run_dir = argv[argv.index("--run-dir") + 2 :]
    assert after_run_dir == expected


def test_sweep_covers_one_node_then_whole_nodes(config_file):
    assert sweep_points(1, 2) == [(1, 1), (1, 2)]
    assert sweep_points(4, 4) == [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16)]
    assert sweep_points(3, 1) == [(1, 1), (2, 2), (3, 3)]
    result = hpctrain(*render_args("sweep", config_file))
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --array=0-3%1\n" in result.stdout
    assert "SWEEP_NODES=(1 1 1 2)\nSWEEP_RANKS=(1 2 4 8)\n" in result.stdout
    assert "--set data.source=benchmark" in result.stdout


@pytest.mark.parametrize(
    "change, message",
    [
        (["--time", "2:0x"], "--time '2:0x': expected one of sbatch's formats"),
        (["--time", "00:61:00"], "61 minutes in hours:minutes:seconds must be below 60"),
        (["--time", "0"], "asks SLURM for no time limit"),
        (["--time", "0"], "greater than zero"),
        (["--time", "00:00"], "greater than zero"),
        (["--nodes", "0"], "--nodes must be a positive integer, got '0'"),
        (["--ntasks-per-node", "two"], "--ntasks-per-node must be a positive integer"),
        (["--cpus-per-task", "-1"], "--cpus-per-task must be a positive integer"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer"),
        (["--mpi", "openmpi"], "--mpi 'openmpi': expected pmix (Open MPI) or pmi2"),
        (["--config", "/no/such/config.yaml"], "--config /no/such/config.yaml: no such file"),
        (["--set", "train.epoch=3"], "train.epoch: unknown key"),
        (["--set", "train.batch_size=0"], "train.batch_size: must be >= 1"),
        (["--partition", "a b"], "--partition 'a b'"),
        (["--log-dir", "my logs"], "--log-dir 'my logs'"),
    ],
)
def test_render_rejects_bad_values_with_one_clear_message(change, message, config_file):
    args = render_args("train", config_file)
    if change[0] in args:
        args[args.index(change[0]) + 1] = change[1]
    else:
        args += change
    result = hpctrain(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("[hpctrain] error: ")


# --- SLURM's own rules: time, memory, modules (issue 29) ----------------------------------


@pytest.mark.parametrize(
    "text, seconds, form",
    [
        ("90", 90 * 60, "minutes"),
        ("25:00", 25 * 60, "minutes:seconds"),  # 25 minutes, as sbatch reads it
        ("90:30", 90 * 60 + 30, "minutes:seconds"),
        ("02:00:00", 2 * 3600, "hours:minutes:seconds"),
        ("36:00:00", 36 * 3600, "hours:minutes:seconds"),
        ("1-12", 36 * 3600, "days-hours"),
        ("2-03:30", (51 * 60 + 30) * 60, "days-hours:minutes"),
        ("1-02:00:00", 26 * 3600, "days-hours:minutes:seconds"),
    ],
)
def test_every_time_format_sbatch_accepts_is_accepted(text, seconds, form, config_file, tmp_path):
    assert templates.TIME_FORMATS[form].match(text)
    assert parse_time(text) == seconds
    out = tmp_path / "job.sbatch"
    args = render_args("train", config_file, "-o", str(out))
    args[args.index("--time") + 1] = text
    result = hpctrain(*args)
    assert result.returncode == 0, result.stderr
    assert f"#SBATCH --time={text}\n" in out.read_text()
    assert f"time limit {templates.describe_seconds(seconds)};" in result.stdout


@pytest.mark.parametrize(
    "text, message",
    [
        ("2:60", "60 seconds in minutes:seconds must be below 60"),
        ("1-24", "24 hours in days-hours must be below 24"),
        ("1-2:60", "60 minutes in days-hours:minutes must be below 60"),
        ("UNLIMITED", "asks SLURM for no time limit"),
        ("1:2:3:4", "expected one of sbatch's formats"),
        ("90m", "expected one of sbatch's formats"),
    ],
)
def test_times_sbatch_would_misread_or_reject_are_refused(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_time(text)


@pytest.mark.parametrize(
    "option, value, written",
    [("--mem", "64G", "64G"), ("--mem", "64g", "64G"), ("--mem", "0", "0")]
    + [("--mem", "512K", "512K"), ("--mem-per-cpu", "3500M", "3500M"), ("--mem", "2T", "2T")],
)
def test_memory_with_its_unit_is_written_as_sbatch_reads_it(option, value, written, config_file):
    assert memory_size(option, value) == written
    result = hpctrain(*render_args("train", config_file, option, value))
    assert result.returncode == 0, result.stderr
    assert f"\n#SBATCH {option}={written}\n" in result.stdout


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--mem", "64", "--mem '64' has no unit, and sbatch would read it as 64 megabytes"),
        ("--mem-per-cpu", "4000", "--mem-per-cpu '4000' has no unit"),
        ("--mem-per-cpu", "0", "--mem-per-cpu '0': must be greater than zero"),
        ("--mem", "0G", "--mem 0, without a unit, asks for all of a node's memory"),
        ("--mem", "64GB", "expected a size like 64G, 4000M or 512K"),
    ],
)
def test_memory_without_a_unit_is_refused_with_the_reason(option, value, message, config_file):
    result = hpctrain(*render_args("train", config_file, option, value))
    assert result.returncode == 2, result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr, result.stderr


def _srun_shim(tmp_path: Path) -> Path:
    """A PATH directory whose `srun` prints its arguments and the threads it was given."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "srun").write_text(
        '#!/bin/bash\necho "OMP $OMP_NUM_THREADS"\nfor a in "$@"; do echo "ARG $a"; done\n'
    )
    (shim / "srun").chmod(0o755)
    (shim / "hpctrain").write_text((shim / "srun").read_text())  # the elastic template's
    (shim / "hpctrain").chmod(0o755)
    return shim


def _srun_options(argv: list[str], name: str) -> list[str]:
    """The srun options a script's launch gave (elastic: those it hands the supervisor
    for every attempt's srun, which adds --nodes, --ntasks and --nodelist itself)."""
    if name != "elastic":
        return argv
    assert argv[:3] == ["elastic", "--launcher", "srun"], argv
    return argv[3].removeprefix("--launcher-args=").split()


def _run_script(script: Path, tmp_path: Path, **env: str):
    full = {"PATH": f"{_srun_shim(tmp_path)}:/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    full.update({"SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1", **env})
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=full, cwd=tmp_path, timeout=30
    )


def _lint(script: Path) -> None:
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(
            ["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60
        )
        assert lint.returncode == 0, lint.stdout


def test_modules_are_loaded_in_order_before_anything_runs(config_file, tmp_path):
    script = tmp_path / "job.sbatch"
    args = render_args("train", config_file, "--module", "cuda/12.2", "--module", "openmpi/4.1")
    result = hpctrain(*args, "--hpctrain", "hpctrain", "-o", str(script))
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert "module load cuda/12.2\nmodule load openmpi/4.1\n" in text
    assert text.index("module load cuda/12.2") < text.index("HPCTRAIN=")
    assert "--module cuda/12.2 --module openmpi/4.1" in text  # the recorded command
    _lint(script)
    # A `module` the submitting shell exported (as Lmod does) runs, in order, first.
    fake = {"BASH_FUNC_module%%": '() {  echo "MODULE $*"; }'}
    run = _run_script(script, tmp_path, **fake)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:2] == ["MODULE load cuda/12.2", "MODULE load openmpi/4.1"], lines
    # Without a `module` command the job stops at once, saying why.
    run = _run_script(script, tmp_path)
    assert run.returncode == 1 and "ARG" not in run.stdout
    assert "this batch shell has no 'module' command" in run.stderr, run.stderr
    bad = hpctrain(*render_args("train", config_file, "--module", "cuda 12"))
    assert bad.returncode == 2 and "--module 'cuda 12': expected one module name" in bad.stderr
    plain = hpctrain(*render_args("train", config_file))
    assert "module load" not in plain.stdout.replace("# module load", "")


# --- GPU options (issue 27 item 1, issue 29 item 2) ---------------------------------------


@pytest.fixture
def gpu_install(monkeypatch):
    """This install's torch as a CUDA build (the renderer reads the build, not a GPU)."""
    monkeypatch.setattr(
        gpus, "install_gpu_support", lambda backend: (True, f"{backend} built with CUDA 12.4")
    )


@pytest.mark.parametrize("name", template_names())
def test_gpu_options_reach_sbatch_and_srun_alike(name, gpu_install, config_file, tmp_path):
    spec = JobSpec(name, 2, 4, "1-00:00:00", str(config_file), hpctrain="hpctrain")
    spec.gpus_per_task, spec.cpus_per_gpu, spec.gpu_bind = 1, 8, "closest"
    spec.overrides = {"pipeline": ["strategy=pipeline"], "moe": MOE_MODEL}.get(name, [])
    if name == "ps":  # on CPU ranks in any installation: refused, --hpctrain or not
        with pytest.raises(ConfigError, match="strategy parameter_server runs on CPU ranks"):
            render(spec)
        return
    rendered = render(spec)
    script = tmp_path / f"{name}.sbatch"
    script.write_text(rendered.text)
    text = rendered.text
    for directive in ("--ntasks=8", "--gpus-per-task=1", "--cpus-per-gpu=8", "--gpu-bind=closest"):
        assert f"\n#SBATCH {directive}\n" in text, directive
    # sbatch: --cpus-per-gpu is "not compatible with the --cpus-per-task option"
    code = [line for line in text.splitlines() if line.startswith("#SBATCH") or line[:1] != "#"]
    assert not [line for line in code if "--cpus-per-task" in line]
    _lint(script)
    if name == "sweep":
        return  # an array: its srun line is checked by the SLURM test of the sweep
    run = _run_script(script, tmp_path, SLURM_NTASKS="8", SLURM_CPUS_PER_GPU="8")
    assert run.returncode == 0, run.stderr
    argv = [line[4:] for line in run.stdout.splitlines() if line.startswith("ARG ")]
    assert "OMP 8" in run.stdout.splitlines()  # one rank's GPU's CPUs
    expected = ["--mpi=pmix", "--ntasks=8", "--cpus-per-gpu=8", "--gpus-per-task=1"]
    expected.append("--gpu-bind=closest")
    if name == "elastic":
        expected.remove("--ntasks=8")
    assert _srun_options(argv, name)[: len(expected)] == expected, argv
    if name in ("pipeline", "moe"):  # on CPU ranks until the GPU check runs them (the
        # job's installation or HPCTRAIN_GPU_UNTESTED may): a warning under --hpctrain
        assert any("ranks would stay on CPUs" in w for w in rendered.warnings), rendered.warnings


def test_gpus_a_config_cannot_use_are_refused_whatever_installation_runs_it(
    config_file, gpu_install
):
    """What no installation of this hpctrain runs on GPU ranks is refused at render even
    where the job names its own installation (--hpctrain), and so is NCCL on fewer GPUs
    than ranks (the job would stop at start); neither asks to install a GPU build."""
    cases = [
        ("ps", [], {}, "strategy parameter_server runs on CPU ranks"),
        ("train", ["backend=tensorflow"], {}, "tensorflow backend trains on CPU ranks only"),
        ("train", ["runtime.device=cpu"], {}, "the config sets runtime.device: cpu"),
        (
            "train",
            ["train.allreduce=nccl"],
            {"gpus_per_node": "2"},
            "NCCL needs one GPU per rank, and the job would stop at start",
        ),
        (
            "train",
            ["train.allreduce=nccl"],
            {"gpus_per_node": "4", "gpu_bind": "single:2"},
            "--gpu-bind single:2 (2 ranks a GPU) and train.allreduce: nccl",
        ),
    ]
    for name, overrides, asked, message in cases:
        spec = JobSpec(name, 2, 4, "60", str(config_file), hpctrain="/opt/other/hpctrain")
        spec.overrides = overrides
        for key, value in (asked or {"gpus_per_task": 1}).items():
            setattr(spec, key, value)
        with pytest.raises(ConfigError, match=re.escape(message)) as caught:
            render(spec)
        assert "install a GPU build" not in str(caught.value), caught.value


def test_gpus_per_node_writes_gres_and_keeps_cpus_per_task(gpu_install, config_file, tmp_path):
    spec = JobSpec("train", 1, 4, "60", str(config_file), cpus_per_task=6, gpus_per_node="a100:4")
    rendered = render(spec)
    assert rendered.warnings == []
    text = rendered.text
    assert "\n#SBATCH --gres=gpu:a100:4\n" in text and "\n#SBATCH --cpus-per-task=6\n" in text
    # no task count or per-task GPUs: each step gets the node's GPUs, one per local rank
    assert "#SBATCH --ntasks=" not in text and "#SBATCH --gpus-per-task" not in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    run = _run_script(script, tmp_path, SLURM_NTASKS="4", SLURM_CPUS_PER_TASK="6")
    argv = [line[4:] for line in run.stdout.splitlines() if line.startswith("ARG ")]
    assert argv[:4] == ["--mpi=pmix", "--ntasks=4", "--cpus-per-task=6", "--kill-on-bad-exit=1"]
    assert "OMP 6" in run.stdout.splitlines()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"gpus_per_node": 4, "gpus_per_task": 1}, "both ask for the GPUs: give one"),
        ({"gpu_bind": "closest"}, "--gpu-bind closest needs GPUs: add --gpus-per-task 1"),
        ({"cpus_per_gpu": 8}, "--cpus-per-gpu 8 needs GPUs"),
        ({"gpus_per_task": 1, "cpus_per_gpu": 8, "cpus_per_task": 2}, "exclude each other"),
        ({"gpus_per_task": 1, "gpu_bind": "nearest"}, "--gpu-bind 'nearest': expected"),
        ({"gpus_per_task": 1, "gpu_bind": "map_gpu:"}, "--gpu-bind 'map_gpu:': expected"),
        ({"gpus_per_task": "0"}, "--gpus-per-task must be a positive integer"),
        ({"gpus_per_node": "a100:"}, "--gpus-per-node must be a positive integer"),
        ({"gpus_per_task": 1, "cpus_per_gpu": 0}, "--cpus-per-gpu must be a positive integer"),
    ],
)
def test_gpu_options_sbatch_would_reject_are_refused(options, message, gpu_install, config_file):
    spec = JobSpec("train", 2, 4, "60", str(config_file), **options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(spec)


@pytest.mark.parametrize(
    "options, warning",
    [
        ({"gpus_per_node": 8}, "4 GPU(s) per node would sit idle"),
        ({"gpus_per_node": 2}, "ranks would share GPUs"),
        ({"gpus_per_task": 2}, "1 of every rank's 2 would sit idle"),
        ({"gpus_per_task": 1, "gpu_bind": "single:2"}, "2 ranks would share each GPU"),
        ({"gpus_per_task": 1, "gpu_bind": "verbose,per_task:2"}, "would see 2 GPUs and use one"),
    ],
)
def test_gpus_that_would_sit_idle_or_be_shared_are_warned(
    options, warning, gpu_install, config_file
):
    rendered = render(JobSpec("train", 2, 4, "60", str(config_file), **options))
    assert any(warning in w for w in rendered.warnings), rendered.warnings


def test_gpus_are_refused_where_this_install_cannot_use_them(config_file, monkeypatch):
    """`--gpus-per-node 4` on a CPU-only torch wrote --gres=gpu:4 without a word; the
    job would hold GPUs it cannot use: refused, or a warning where the job runs another
    install (--hpctrain), which cannot be inspected from here."""
    usable, found = gpus.install_gpu_support("torch")
    assert found.startswith("torch ") and ("CPU-only build" in found) is not usable, found
    result = hpctrain(*render_args("train", config_file, "--gpus-per-node", "4"))
    if usable:  # a CUDA build (the GPU machine): GPUs are what it is for
        assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    else:
        assert result.returncode == 2, result.stdout
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        for part in ("--gpus-per-node 4 asks for GPUs, but torch ", "is a CPU-only build"):
            assert part in result.stderr, result.stderr
        assert "--hpctrain CMD" in result.stderr
    # The same decision whatever this machine has, through the renderer itself.
    cpu_build = (False, "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None)")
    monkeypatch.setattr(gpus, "install_gpu_support", lambda backend: cpu_build)
    spec = JobSpec("train", 1, 4, "60", str(config_file), gpus_per_task=1)
    with pytest.raises(ConfigError, match=r"--gpus-per-task 1 asks for GPUs, but torch 2\.13"):
        render(spec)
    spec.hpctrain = "/opt/gpu-venv/bin/hpctrain"
    warned = render(spec).warnings
    assert any("the job runs /opt/gpu-venv/bin/hpctrain" in w for w in warned), warned
    # runtime.device: cpu with GPUs is the same mistake; cuda without GPUs a warning.
    monkeypatch.setattr(gpus, "install_gpu_support", lambda backend: (True, "CUDA build"))
    spec = JobSpec("train", 1, 4, "60", str(config_file), gpus_per_task=1)
    spec.overrides = ["runtime.device=cpu"]
    if "device" in config_module.SCHEMA["runtime"]:
        with pytest.raises(ConfigError, match="the config sets runtime.device: cpu"):
            render(spec)
        spec.overrides, spec.gpus_per_task = ["runtime.device=cuda"], None
        try:
            warned = render(spec).warnings
        except ConfigError as exc:  # the config itself refuses cuda without a GPU here
            assert "runtime.device=cuda" in str(exc)
        else:
            assert any("no GPU option was given" in w for w in warned), warned


def test_docs_list_every_render_option():
    """Every option `hpctrain slurm render --help` shows is in docs/slurm.md."""
    result = hpctrain("slurm", "render", "--help")
    assert result.returncode == 0, result.stderr
    options = set(re.findall(r"^\s{2}(--[a-z][a-z0-9-]*)", result.stdout, re.M))
    options |= set(re.findall(r", (--[a-z][a-z0-9-]*)", result.stdout))
    options -= {"--help"}
    assert {"--gpus-per-task", "--gpu-bind", "--cpus-per-gpu", "--module"} <= options
    doc = (Path(__file__).resolve().parents[1] / "docs" / "slurm.md").read_text()
    missing = sorted(o for o in options if not re.search(rf"`{re.escape(o)}(?![\w-])", doc))
    assert not missing, f"docs/slurm.md does not describe {missing}"


def test_render_names_unknown_templates_and_placeholders(config_file, tmp_path):
    result = hpctrain(*render_args("trian", config_file))
    assert result.returncode == 2
    assert (
        "template 'trian': not a file and not one of elastic, moe, pipeline, ps, sweep, train"
        in (result.stderr)
    )
    custom = tmp_path / "mine.sbatch"
    custom.write_text("#!/bin/bash\n#SBATCH --nodes={{nodes}}\nsrun {{hpctrain}} {{nodez}}\n")
    result = hpctrain(*render_args(str(custom), config_file))
    assert result.returncode == 2
    assert f"{custom}:3: unknown placeholder {{{{nodez}}}}" in result.stderr


def test_template_strategy_must_match_the_config(config_file):
    result = hpctrain(*render_args("pipeline", config_file))
    assert result.returncode == 2
    assert "strategy" in result.stderr and "pipeline" in result.stderr, result.stderr


def test_the_elastic_template_needs_checkpoints(config_file):
    """It restarts from checkpoints: a config without them is refused at render time."""
    result = hpctrain(*render_args("elastic", config_file, "--set", "checkpoint.enabled=false"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "template elastic.sbatch restarts from checkpoints" in result.stderr, result.stderr


def test_submit_without_sbatch_says_where_to_run_it(config_file, tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    args = render_args("train", config_file, "--log-dir", str(tmp_path / "logs"))
    args[1] = "submit"
    result = hpctrain(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert "sbatch not found on PATH" in result.stderr
    # the default script is the record of what was submitted: nothing was, so none stays
    assert "(nothing submitted; its script " in result.stderr, result.stderr
    assert list((tmp_path / "logs").glob("*.sbatch")) == []
    named = tmp_path / "job.sbatch"  # a script the user named stays where they asked
    result = hpctrain(*args, "-o", str(named), env=env)
    assert result.returncode == 2 and f"the script stays in {named})" in result.stderr
    assert named.exists()


# --- srun rank mapping ---------------------------------------------------------------------


def test_srun_pmi2_launch_is_recognised_as_srun():
    # Task 1's variables as `srun --mpi=pmi2 -n 2` (job 1, step 0) sets them here: its
    # PMI_* are srun's own, not MPICH hydra's, so the srun view (and its checks) applies.
    env = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "PMI_FD": "13",
        "PMI_JOBID": "1.0",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
    }
    views = launcher_views(env)
    assert [v.name for v in views] == ["srun (SLURM)"]
    assert views[0].values == {"rank": 1, "size": 2, "local_rank": 1, "node": 0}
    # hydra inside an allocation: its proxy is srun task 0, the rank comes from PMI.
    hydra = dict(env, SLURM_PROCID="0", SLURM_LOCALID="0", PMI_RANK="3", PMI_SIZE="4")
    del hydra["PMI_JOBID"]
    assert [v.name for v in launcher_views(hydra)] == ["hydra (MPICH)"]


# --- on a real SLURM -----------------------------------------------------------------------


def test_srun_rank_mapping_matches_mpi(slurm):
    job = slurm.run("srun", "--mpi=pmix", "-n", "2", HPCTRAIN, "doctor", timeout=240)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert "2 rank(s), launcher: srun (SLURM)" in out
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+2\s+0\s+\S+$", out, re.M)
    assert sorted(rows) == [("0", "0"), ("1", "1")], out
    assert "doctor: all checks passed" in out


def test_a_stale_slurm_procid_is_refused_on_every_rank(slurm):
    # The classic broken template: the batch shell's SLURM_PROCID=0 given to every task.
    job = slurm.run(
        "srun", "--mpi=pmix", "-n", "2", "env", "SLURM_PROCID=0", HPCTRAIN, "doctor", timeout=240
    )
    out = job.stdout + job.stderr
    assert job.returncode != 0, out
    assert "SLURM_PROCID=0 (srun (SLURM)) but MPI says rank=1" in out, out
    assert out.count("launcher variables disagree with MPI") == 1, out  # agreed: said once


def _job_logs(directory: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(directory.glob("*.*")))


@pytest.mark.timeout(420)
def test_sbatch_of_the_rendered_train_template_trains_on_two_ranks(slurm, config_file, tmp_path):
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    args = ["slurm", "submit", "train", "--nodes", "1", "--ntasks-per-node", "2"]
    args += ["--time", "00:10:00", "--config", str(config_file), *TINY]
    args += ["--log-dir", str(logs), "--run-root", str(runs)]
    submitted = hpctrain(*args, cwd=tmp_path, env=slurm.env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.isdigit(), submitted.stdout
    info = slurm.wait_job(job_id, timeout=360)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _job_logs(logs))
    metrics = runs / f"hpctrain-train-{job_id}" / "metrics.jsonl"
    summary = json.loads(metrics.read_text().splitlines()[-1])
    assert summary["event"] == "summary" and summary["world_size"] == 2, summary
    out = (logs / f"hpctrain-train-{job_id}.out").read_text()
    assert f"job {job_id} (restart 0): 2 ranks on localhost" in out


@pytest.mark.timeout(420)
def test_a_job_suspended_and_resumed_by_scontrol_finishes(
    slurm, config_file, tmp_path, monkeypatch
):
    """`scontrol suspend` stops every process of the job (SIGSTOP) and `scontrol resume`
    continues them: for longer than the collective timeout, the watchdog ended the job
    at once on resume. Its deadlines now leave out the time the processes did not run.
    Meanwhile its run marker, stale as if it had run on another host, is not taken over:
    SLURM says the job is suspended (run_marker.py; test_run_marker.py for the rest)."""
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    args = ["slurm", "submit", "train", "--nodes", "1", "--ntasks-per-node", "2"]
    args += ["--time", "00:10:00", "--config", str(config_file), *TINY]
    args += ["--set", "train.epochs=2", "--set", "data.train_samples=8192"]
    args += ["--set", "runtime.collective_timeout=3"]
    args += ["--set", "train.log_every=1", "--log-dir", str(logs), "--run-root", str(runs)]
    # 30 ms a step on rank 0 (~4 s an epoch): the suspension lands among the first
    # epoch's steps. Unslowed, the job ran 256 steps a second, so it fell where the test's
    # poll let it: once into the epoch-end checkpoint's commit, where rank 0's watchdog
    # did not see its pause (the job still finished), and it could miss the job entirely.
    env = {**slurm.env, "HPCTRAIN_FAULT_STEP_SLEEP": "0:0.03"}
    submitted = hpctrain(*args, cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        _wait_for_steps(runs / f"hpctrain-train-{job_id}" / "metrics.jsonl", 3, logs)
        assert slurm.run("scontrol", "suspend", job_id).returncode == 0
        suspended_at = time.monotonic()
        elsewhere = _stale_marker_of(tmp_path / "elsewhere", job_id)
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        with pytest.raises(ConfigError, match="SLURM says its job is SUSPENDED"):
            run_marker.claim(elsewhere, env={})
        # past the collective timeout, and 5 s (clock.NOT_RUNNING_SECONDS) beyond a poll
        # once slurmd's SIGSTOPs arrived (a second or two late on a loaded machine)
        time.sleep(max(0.0, suspended_at + 10 - time.monotonic()))
        assert slurm.job(job_id)["JobState"] == "SUSPENDED", _job_logs(logs)
        assert slurm.run("scontrol", "resume", job_id).returncode == 0
        info = slurm.wait_job(job_id, timeout=300)
    finally:
        slurm.run("scancel", job_id, timeout=20)
    run_marker.claim(elsewhere, env={}).release()  # the job ended: taken over
    out = _job_logs(logs)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
    assert re.search(r"watchdog: its thread did not run for \d+ s", out), out
    metrics = runs / f"hpctrain-train-{job_id}" / "metrics.jsonl"
    summary = [json.loads(x) for x in metrics.open() if '"summary"' in x][-1]
    assert summary["suspended_sec"] > 5.0, summary  # left out of elapsed_sec and samples/s


def _stale_marker_of(run_dir: Path, job_id: str) -> Path:
    """`run_dir` with a run marker of SLURM job `job_id` from another host, older than
    run_marker.STALE_S: its heartbeat stopped."""
    run_dir.mkdir()
    marker = run_dir / run_marker.MARKER
    marker.write_text(json.dumps({"host": "hpcn9", "pid": 123, "job": job_id}))
    old = time.time() - run_marker.STALE_S - 5
    os.utime(marker, (old, old))
    return run_dir


REQUEUE_JOB = f"""#!/bin/bash
#SBATCH --time=00:05:00
#SBATCH --output={{log}}
#SBATCH --open-mode=append
if [ "${{{{SLURM_RESTART_COUNT:-0}}}}" = 0 ]; then
    if {PYTHON} -c '
import sys
from hpctrain.runtime.preemption import Preemption
ok = Preemption().requeue()
print("requeued: " + str(ok), flush=True)  # one write: slurmstepd appends its own line
sys.exit(0 if ok else 3)'; then
        sleep 60  # scontrol requeue ends this run long before
    fi
fi
echo finished
"""


@pytest.mark.parametrize(
    "sbatch_args, requeued",
    [(["--requeue"], True), (["--requeue", "--array=3-3"], True), (["--no-requeue"], False)],
    ids=["job", "array-task", "no-requeue"],
)
def test_requeue_puts_the_running_job_back_in_the_queue(slurm, tmp_path, sbatch_args, requeued):
    log = tmp_path / "job.out"
    script = tmp_path / "job.sbatch"
    script.write_text(REQUEUE_JOB.format(log=log))
    sub = slurm.run("sbatch", "--parsable", *sbatch_args, str(script), cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    if "--array=3-3" in sbatch_args:
        job_id = f"{job_id}_3"
    try:
        if requeued:
            deadline_info, deadline = {}, time.monotonic() + 60
            while time.monotonic() < deadline:
                deadline_info = slurm.job(job_id)
                if deadline_info.get("Restarts") == "1":
                    break
                time.sleep(0.25)
            assert deadline_info.get("Restarts") == "1", (deadline_info, log.read_text())
            # Restarts=1 is the requeue; a loaded node can still be COMPLETING the first
            # run's epilog at that moment (seen once): anything but an ended job
            assert deadline_info["JobState"] in ("PENDING", "REQUEUED", "RUNNING", "COMPLETING")
            text = log.read_text()
            # requeue() printed True, or SLURM ended this run for the requeue first: scontrol
            # returns once the controller took it, and a loaded node killed the batch step
            # before python's next line (seen once, make test's two processes at load ~20)
            assert "requeued: True" in text or "DUE TO JOB REQUEUE" in text, text
            assert "requeued: False" not in text, text
        else:
            info = slurm.wait_job(job_id, timeout=120)
            text = log.read_text()
            assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
            assert "requeued: False" in text and "finished" in text
            assert f"`scontrol requeue {job_id}` failed" in text
            assert "submitted without --requeue" in text
    finally:
        slurm.run("scancel", job_id, timeout=20)


@pytest.mark.timeout(420)
def test_sweep_array_runs_every_point_into_the_results_dir(slurm, config_file, tmp_path):
    logs, results = tmp_path / "logs", tmp_path / "results"
    args = ["slurm", "submit", "sweep", "--nodes", "1", "--ntasks-per-node", "2"]
    args += ["--time", "10", "--config", str(config_file), *TINY]
    args += ["--log-dir", str(logs), "--results-dir", str(results)]
    submitted = hpctrain(*args, cwd=tmp_path, env=slurm.env)
    assert submitted.returncode == 0, submitted.stderr
    array_id = submitted.stdout.strip()
    for task in (0, 1):
        info = slurm.wait_job(f"{array_id}_{task}", timeout=300)
        assert info["JobState"] == "COMPLETED", (info, _job_logs(logs))
    for ranks in (1, 2):
        metrics = results / f"hpctrain-sweep-{array_id}" / f"nodes1-ranks{ranks}" / "metrics.jsonl"
        summary = json.loads(metrics.read_text().splitlines()[-1])
        assert summary["world_size"] == ranks and summary["samples_per_sec"] > 0, summary
    assert (logs / f"hpctrain-sweep-{array_id}_1.out").is_file()


PREEMPT_CONFIG = """\
model: {name: mlp, hidden: [256, 256]}
data: {train_samples: 65536, val_samples: 1024}
optimizer: {name: adam, lr: 0.001, lr_scaling: none}
train: {epochs: 3, batch_size: 64, log_every: 1}
metrics: {tensorboard: false}
"""


def _wait_for_steps(metrics: Path, steps: int, logs: Path, timeout: float = 240) -> None:
    """Until a job's metrics.jsonl holds `steps` step records (its logs if it never does)."""
    deadline, done = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and done < steps:
        if metrics.exists():
            done = sum(1 for line in metrics.open() if '"event": "step"' in line)
        time.sleep(0.2)
    assert done >= steps, _job_logs(logs)


def _final_model(run_dir: Path) -> dict:
    from hpctrain.checkpoint import find_latest_valid

    ckpt = find_latest_valid(run_dir / "checkpoints")
    assert ckpt is not None, f"no checkpoint in {run_dir}"
    return ckpt.step, {k: v for k, v in ckpt.state.items() if k.startswith("model/")}


@pytest.mark.timeout(600)
# One node's case of test_multinode.py's two-node preemption and requeue (which runs in
# `make test` with the same checks); 18-22 s per template, so it runs in `make
# test-extended`. The elastic template's ranks get SLURM's SIGUSR1 as the train
# template's do (not the supervisor, the batch shell): they checkpoint and requeue.
@pytest.mark.extended
@pytest.mark.parametrize("template", ["train", "elastic"])  # elastic: its ranks get the signal
def test_preemption_checkpoints_requeues_and_the_requeued_job_finishes_identically(
    slurm, tmp_path, template
):
    import numpy as np
    from mpirun import mpirun

    config = tmp_path / "preempt.yaml"
    config.write_text(PREEMPT_CONFIG)
    # The uninterrupted reference, same config, same 2 ranks.
    ref = tmp_path / "ref"
    job = mpirun(2, HPCTRAIN, "train", "--config", str(config), "--run-dir", str(ref), timeout=300)
    assert job.returncode == 0, job.output
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    args = [
        "slurm",
        "submit",
        template,
        "--nodes",
        "1",
        "--ntasks-per-node",
        "2",
        "--time",
        "00:10:00",
        "--config",
        str(config),
        "--log-dir",
        str(logs),
        "--run-root",
        str(runs),
    ]
    # Extra arguments (sbatch passes the environment on) must not drop --resume auto.
    env = {**slurm.env, "HPCTRAIN_EXTRA_ARGS": "--verbose"}
    submitted = hpctrain(*args, cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    metrics = runs / f"hpctrain-{template}-{job_id}" / "metrics.jsonl"
    try:
        _wait_for_steps(metrics, 40, logs)
        # What SLURM does 90 s before the time limit (--signal=USR1@90), sent now.
        sig = slurm.run("scancel", "--signal=USR1", job_id, timeout=20)
        assert sig.returncode == 0, sig.stderr
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and slurm.job(job_id).get("Restarts") != "1":
            time.sleep(0.5)
        assert slurm.job(job_id).get("Restarts") == "1", _job_logs(logs)
        # Once the first run has ended and the job is pending again, let it start now
        # (a requeued job otherwise waits ~2 minutes, Reason=BeginTime).
        slurm.start_requeued_now(job_id, timeout=240)
        out_file = logs / f"hpctrain-{template}-{job_id}.out"
        deadline = time.monotonic() + 360
        info, rerun = {}, False
        while time.monotonic() < deadline:
            info = slurm.job(job_id)
            rerun = "(restart 1)" in out_file.read_text()
            if info.get("JobState") in TERMINAL_STATES or not info:
                break
            time.sleep(0.25)
        diagnosis = slurm.diagnose(job_id)
    finally:
        slurm.run("scancel", job_id, timeout=20)
    out = _job_logs(logs)
    assert rerun, (info, out, diagnosis)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        info,
        out,
        diagnosis,
    )
    assert "SIGUSR1 received: stopped at step" in out, out
    assert "requeueing the job" in out and "(restart 1)" in out, out
    assert "resumed from" in out, out
    lines = [json.loads(x) for x in metrics.open()]
    summaries = [x for x in lines if x["event"] == "summary"]
    assert summaries[0]["preempted"] == "SIGUSR1" and summaries[-1]["preempted"] is None
    assert summaries[-1]["resumed_from"]
    ref_step, ref_model = _final_model(ref)
    step, model = _final_model(runs / f"hpctrain-{template}-{job_id}")
    assert step == ref_step == 3 * 65536 // 128
    for k in ref_model:
        np.testing.assert_array_equal(model[k], ref_model[k], err_msg=k)


# `make test-extended`: the way docs/slurm.md gives to end a job for good, checked on
# the daemons (scancel's --signal reaches the steps' tasks, not through srun).
@pytest.mark.extended
def test_scancel_signal_usr2_stops_the_job_with_a_checkpoint_and_no_requeue(slurm, tmp_path):
    config = tmp_path / "stop.yaml"
    config.write_text(PREEMPT_CONFIG)
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    args = ["slurm", "submit", "train", "--nodes", "1", "--ntasks-per-node", "2"]
    args += ["--time", "00:10:00", "--config", str(config), "--log-dir", str(logs)]
    submitted = hpctrain(*args, "--run-root", str(runs), cwd=tmp_path, env=slurm.env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    metrics = runs / f"hpctrain-train-{job_id}" / "metrics.jsonl"
    try:
        _wait_for_steps(metrics, 20, logs)
        sig = slurm.run("scancel", "--signal=USR2", job_id, timeout=20)
        assert sig.returncode == 0, sig.stderr
        info = slurm.wait_job(job_id, timeout=120)
        diagnosis = slurm.diagnose(job_id)
    finally:
        slurm.run("scancel", job_id, timeout=20)
    out = _job_logs(logs)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        info,
        out,
        diagnosis,
    )
    assert info.get("Restarts") == "0" and "requeueing the job" not in out, out
    assert out.count("SIGUSR2 received: stopped at step") == 1, out  # rank 0's line
    assert "not requeued" in out, out
    summary = [json.loads(x) for x in metrics.open() if '"summary"' in x][-1]
    assert summary["preempted"] == "SIGUSR2", summary
    assert list((runs / f"hpctrain-train-{job_id}" / "checkpoints").glob("ckpt-*.h5")), out


# `make test-extended` (13-18 s): `make test` has the supervisor's new srun step inside
# the allocation (the elastic template on the emulated nodes, test_multinode.py) and a
# killed rank's restart ending bit for bit under mpirun (test_elastic.py).
@pytest.mark.extended
@pytest.mark.timeout(420)
def test_elastic_restarts_a_failed_srun_step_inside_the_allocation(slurm, tmp_path):
    """`hpctrain elastic --launcher srun` in a batch script: rank 1 is killed at step 8,
    the step fails, and the supervisor runs a new srun step of the same allocation from
    the step-6 checkpoint; the job ends bit for bit where an uninterrupted run ends."""
    from mpirun import mpirun
    from test_elastic import SMALL  # the job of the mpirun elastic tests

    from hpctrain.checkpoint import find_latest_valid, load

    sets = [w for o in SMALL for w in ("--set", o)]
    ref = tmp_path / "ref"
    plain = mpirun(2, HPCTRAIN, "train", "--run-dir", str(ref), *sets, timeout=240)
    assert plain.returncode == 0, plain.output
    run, log = tmp_path / "run", tmp_path / "elastic.out"
    script = tmp_path / "elastic.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --time=00:06:00\n"
        f"#SBATCH --output={log}\n"
        "export HPCTRAIN_FAULT_DIE_AT_STEP=1:8\n"
        f"{HPCTRAIN} elastic --launcher srun --launcher-args=--mpi=pmix --max-restarts 2 "
        f"--probe-timeout 2 -- train --run-dir {run} {' '.join(sets)}\n"
    )
    sub = slurm.run("sbatch", "--parsable", str(script), cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    info = slurm.wait_job(job_id, timeout=360)
    out = log.read_text() if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
    events = [json.loads(x) for x in (run / "elastic" / "events.jsonl").open()]
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "launch", "failure", "probe", "launch", "end"], (kinds, out)
    assert events[0]["launcher"] == "srun" and events[0]["hosts"] == ["localhost"], events
    assert "restart 1 of 2: 2 ranks on localhost" in out, out
    assert "resumed from" in out and "at step 6" in out, out
    a = load(find_latest_valid(run / "checkpoints").path).model_weights()
    b = load(find_latest_valid(ref / "checkpoints").path).model_weights()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
