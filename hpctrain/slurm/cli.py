"""`hpctrain slurm render|submit`: sbatch scripts that launch every rank with srun.

Neither action starts MPI: they run on a login node, validate everything a job would
otherwise trip over in the queue, and either print/write the script or hand it to
`sbatch --parsable`, printing only the job id on stdout (so `JOB=$(hpctrain slurm
submit ...)` works in scripts).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ConfigError, LaunchError, require_path
from .templates import MPI_PLUGINS, JobSpec, Rendered, describe_seconds, render, template_names

SBATCH_TIMEOUT_S = 60

EPILOG = """\
example:
  hpctrain slurm render train --nodes 2 --ntasks-per-node 4 --cpus-per-task 8 \\
      --time 12:00:00 --config configs/demo.yaml -o train-demo.sbatch
  sbatch train-demo.sbatch
  (or, in one step: hpctrain slurm submit train ... with the same options)
  GPU nodes, one rank per GPU:
  hpctrain slurm render train --nodes 2 --ntasks-per-node 4 --gpus-per-task 1 \\
      --cpus-per-gpu 8 --gpu-bind closest --module cuda/12.2 --mem 200G \\
      --time 1-00:00:00 --config configs/demo.yaml -o train-gpu.sbatch

templates ({names}) use {{{{placeholders}}}}: see hpctrain/slurm/templates.py.
"""


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("template", help=f"a template name ({', '.join(template_names())}) or a file")
    _add_allocation(p)
    _add_gpus(p)
    _add_site(p)
    _add_job(p)


def _add_allocation(p: argparse.ArgumentParser) -> None:
    """What every job needs: nodes, ranks, time, config (and CPUs, partition)."""
    req = p.add_argument_group("required")
    req.add_argument("--nodes", required=True, metavar="N", help="nodes to allocate")
    req.add_argument(
        "--ntasks-per-node", required=True, metavar="T", help="ranks (SLURM tasks) per node"
    )
    req.add_argument(
        "--time",
        required=True,
        metavar="TIME",
        help="time limit in any sbatch format: minutes, minutes:seconds, "
        "hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds",
    )
    req.add_argument("--config", "-c", required=True, metavar="FILE", help="hpctrain config")
    p.add_argument(
        "--cpus-per-task", metavar="C", help="CPUs per rank (default 1; not with --cpus-per-gpu)"
    )
    p.add_argument("--partition", metavar="P", help="adds --partition=P (default: site default)")


def _add_gpus(p: argparse.ArgumentParser) -> None:
    """SLURM's GPU options, checked against the config by slurm/gpus.py."""
    gpu = p.add_argument_group(
        "GPUs (one rank per GPU; refused where this install or config cannot use them)"
    )
    gpu.add_argument(
        "--gpus-per-node",
        metavar="[TYPE:]G",
        help="adds --gres=gpu:G; G equal to --ntasks-per-node (default: no GPUs)",
    )
    gpu.add_argument(
        "--gpus-per-task",
        metavar="[TYPE:]N",
        help="adds --gpus-per-task=N (and --ntasks) for sbatch and srun; 1 for one rank per GPU",
    )
    gpu.add_argument(
        "--gpu-bind",
        metavar="SPEC",
        help="adds --gpu-bind=SPEC for sbatch and srun: closest, none, single:1, per_task:1, "
        "map_gpu:LIST or mask_gpu:LIST, each optionally prefixed with 'verbose,' "
        "(verbose,closest)",
    )
    gpu.add_argument(
        "--cpus-per-gpu",
        metavar="C",
        help="CPUs per GPU, instead of --cpus-per-task (sbatch and srun)",
    )


def _add_site(p: argparse.ArgumentParser) -> None:
    """Site options, each one #SBATCH line, and modules loaded before anything runs."""
    site = p.add_argument_group("site options (each adds its #SBATCH line)")
    site.add_argument("--account", "-A", metavar="ACCOUNT", help="charge the job to ACCOUNT")
    site.add_argument("--qos", metavar="QOS", help="quality of service")
    site.add_argument(
        "--mem",
        metavar="SIZE",
        help="memory per node with its unit (K, M, G, T), e.g. 64G (0: all)",
    )
    site.add_argument(
        "--mem-per-cpu", metavar="SIZE", help="memory per CPU with its unit, e.g. 4G or 3500M"
    )
    site.add_argument("--exclusive", action="store_true", help="whole nodes, not shared")
    site.add_argument(
        "--constraint", "-C", metavar="FEATURES", help="node features, e.g. 'a100&ib'"
    )
    site.add_argument(
        "--sbatch-line",
        dest="sbatch_lines",
        action="append",
        default=[],
        metavar="OPTION",
        help="any other sbatch option, e.g. --sbatch-line=--mail-type=END (repeatable)",
    )
    site.add_argument(
        "--module",
        dest="modules",
        action="append",
        default=[],
        metavar="NAME",
        help="a site module the job loads first (`module load NAME`; repeatable, in order)",
    )


def _add_job(p: argparse.ArgumentParser) -> None:
    """How the job launches hpctrain and where its files go."""
    p.add_argument(
        "--mpi",
        default="pmix",
        metavar="PLUGIN",
        help=f"srun --mpi plugin: {' or '.join(MPI_PLUGINS)} (pmix for Open MPI, the "
        "default; pmi2 for MPICH / Intel MPI builds)",
    )
    p.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to the job (validated now; repeatable)",
    )
    p.add_argument("--job-name", metavar="NAME", help="default hpctrain-<template>")
    p.add_argument(
        "--log-dir",
        default=".",
        metavar="DIR",
        help="where %%x-%%j.out/.err go, relative to the submit directory (default .)",
    )
    p.add_argument(
        "--run-root",
        default="runs",
        metavar="DIR",
        help="run directories go to DIR/<job name>-<job id> (default runs)",
    )
    p.add_argument(
        "--results-dir",
        default="benchmarks/results",
        metavar="DIR",
        help="sweep results root (default benchmarks/results)",
    )
    p.add_argument(
        "--hpctrain", metavar="CMD", help="hpctrain command the job runs (default: this one)"
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="write the script here (chmod +x); submit's default: "
        "<log-dir>/<job name>-<UTC time>.sbatch",
    )


def register(subparsers) -> dict:
    """Add `hpctrain slurm` (hook of hpctrain.cli.COMMAND_MODULES)."""
    p = subparsers.add_parser(
        "slurm",
        help="render or submit sbatch scripts (srun direct launch, USR1 requeue)",
        description="Fill a SLURM batch template with validated values. The scripts "
        "launch one rank per task with `srun --mpi=pmix` and requeue on SIGUSR1.",
    )
    sub = p.add_subparsers(dest="slurm_command", metavar="ACTION", required=True)
    epilog = EPILOG.format(names=", ".join(template_names()))
    for action, text in (
        ("render", "print the filled script, or write it with -o"),
        ("submit", "render, then sbatch it; prints the job id"),
    ):
        s = sub.add_parser(
            action,
            help=text,
            description=text[0].upper() + text[1:] + ". Exits 2 on any invalid value.",
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_options(s)
    return {"slurm": _cmd_slurm}


def _spec(args) -> JobSpec:
    return JobSpec(
        template=args.template,
        nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node,
        time=args.time,
        config=args.config,
        cpus_per_task=args.cpus_per_task,
        gpus_per_node=args.gpus_per_node,
        gpus_per_task=args.gpus_per_task,
        gpu_bind=args.gpu_bind,
        cpus_per_gpu=args.cpus_per_gpu,
        partition=args.partition,
        mpi=args.mpi,
        overrides=args.overrides,
        job_name=args.job_name,
        log_dir=args.log_dir,
        run_root=args.run_root,
        results_dir=args.results_dir,
        hpctrain=args.hpctrain,
        command=_command_line(args),
        account=args.account,
        qos=args.qos,
        mem=args.mem,
        mem_per_cpu=args.mem_per_cpu,
        exclusive=args.exclusive,
        constraint=args.constraint,
        sbatch_lines=args.sbatch_lines,
        modules=args.modules,
    )


def _command_line(args) -> str:
    """The render command that reproduces this script (recorded in its header)."""
    words = ["hpctrain", "slurm", "render", args.template]
    for option in (
        "nodes",
        "ntasks_per_node",
        "cpus_per_task",
        "gpus_per_node",
        "gpus_per_task",
        "gpu_bind",
        "cpus_per_gpu",
        "partition",
        "account",
        "qos",
        "mem",
        "mem_per_cpu",
        "constraint",
        "time",
        "mpi",
        "config",
        "job_name",
        "log_dir",
        "run_root",
        "results_dir",
        "hpctrain",  # the command the job runs: a login node's own may be a CPU build
    ):
        value = getattr(args, option)
        if value is not None:
            words += [f"--{option.replace('_', '-')}", str(value)]
    if args.exclusive:
        words.append("--exclusive")
    for line in args.sbatch_lines:
        words.append(f"--sbatch-line={line}")
    for name in args.modules:
        words += ["--module", name]
    for override in args.overrides:
        words += ["--set", override]
    return shlex.join(words)


RENDERED_MARK = "# rendered by: hpctrain"  # the templates' line 3-9 (`generated`)


DIGEST_MARK = "# hpctrain render digest: "  # a written script's last line: its text's
_MOST_READ = 1 << 20  # a rendered script is a few kB


def _digest_line(text: str) -> str:
    return f"{DIGEST_MARK}{hashlib.sha256(text.encode()).hexdigest()[:16]}\n"


def _refuse_replacing_what_was_not_rendered(path: Path) -> None:
    """-o replaces a script an earlier render wrote and nobody edited since (re-rendering
    is how one changes), never another file (a config, a hand-written sbatch script) nor
    a rendered script edited by hand: its last line holds the digest of what render
    wrote, whether to -o or to stdout (a script rendered before the digest has none and
    is replaced as before)."""
    try:
        with path.open(errors="replace") as f:
            text = f.read(_MOST_READ)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
    lines = text.splitlines(keepends=True)
    if not any(line.startswith(RENDERED_MARK) for line in lines[:12]):
        raise ConfigError(
            f"{path} exists and is not a script `hpctrain slurm render` wrote (no "
            f"'{RENDERED_MARK}' line): choose another -o FILE, or move that file away"
        )
    marks = [i for i, line in enumerate(lines) if line.startswith(DIGEST_MARK)]
    body = "".join(line for i, line in enumerate(lines) if i not in marks[-1:])
    if marks and lines[marks[-1]].strip() != _digest_line(body).strip():
        raise ConfigError(
            f"{path} was edited since `hpctrain slurm render` wrote it (its digest line "
            "no longer matches), and rendering again would lose the edits: choose another "
            "-o FILE, or move that file away"
        )


def _write(path: Path, rendered: Rendered) -> Path:
    _refuse_replacing_what_was_not_rendered(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered.text + _digest_line(rendered.text))
        path.chmod(0o755)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
    return path


def sbatch(script: Path, timeout: float = SBATCH_TIMEOUT_S) -> str:
    """Submit `script` with `sbatch --parsable`; the job id, or a LaunchError."""
    try:
        proc = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        raise LaunchError(
            "sbatch not found on PATH: submit from a SLURM login node, or write the "
            "script with `hpctrain slurm render ... -o FILE`"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"sbatch did not answer within {timeout:g} s (is slurmctld up? try `sinfo`)"
        ) from None
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no message").splitlines()[-1]
        raise LaunchError(f"sbatch {script} failed (exit {proc.returncode}): {detail}")
    job_id = proc.stdout.strip().splitlines()[-1].split(";")[0] if proc.stdout.strip() else ""
    if not job_id.isdigit():
        raise LaunchError(f"sbatch {script}: unexpected answer {proc.stdout.strip()!r}")
    return job_id


def _not_submitted(exc: Exception, script: Path, kept: bool) -> Exception:
    """The error of a submission that failed. The default script is the record of what
    was submitted (one per submission), so one that was not submitted is removed; a
    script named with -o stays where the user asked for it."""
    if kept:
        return type(exc)(f"{exc} (nothing submitted; the script stays in {script})")
    with contextlib.suppress(OSError):
        script.unlink()
    return type(exc)(f"{exc} (nothing submitted; its script {script} was removed)")


def _render_to_file(path: Path, log_dir: Path, rendered: Rendered) -> None:
    """Write the script and say how to submit it: a script it replaced is named as such
    (re-rendering is the way to change one), and a missing --log-dir is created in the
    advice, because SLURM does not create it and the job could not open its output."""
    replaced = path.exists()
    _write(path, rendered)
    submit = f"sbatch {shlex.quote(str(path))}"
    if not log_dir.is_dir():
        submit = f"mkdir -p {shlex.quote(str(log_dir))} && {submit}"
    print(
        f"{'replaced' if replaced else 'wrote'} {path} (time limit "
        f"{describe_seconds(rendered.seconds)}; submit with: {submit})"
    )


# the options that name a path, and what they name
PATH_OPTIONS = {
    "log_dir": "directory",
    "run_root": "directory",
    "results_dir": "directory",
    "output": "file",
}


def _refuse_empty_paths(args) -> None:
    """An empty (or blank) path is refused (errors.require_path)."""
    for name, kind in PATH_OPTIONS.items():
        if getattr(args, name) is not None:
            require_path(f"--{name.replace('_', '-')}", getattr(args, name), kind)


def _cmd_slurm(args) -> int:
    _refuse_empty_paths(args)
    rendered = render(_spec(args))
    for note in rendered.warnings:
        print(f"[hpctrain] warning: {note}", file=sys.stderr)
    if args.slurm_command == "render":
        if args.output is None:
            # the digest too: `render > FILE`, edited, is then kept from a later -o
            sys.stdout.write(rendered.text + _digest_line(rendered.text))
        else:
            _render_to_file(Path(args.output), Path(args.log_dir), rendered)
        return 0
    log_dir = Path(args.log_dir)
    if args.output is not None:
        script = Path(args.output)
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        script = log_dir / f"{rendered.job_name}-{stamp}.sbatch"
    if script.exists():  # re-rendering is how a script changes; never silently
        print(f"[hpctrain] replacing {script}", file=sys.stderr)
    _write(script, rendered)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)  # SLURM does not create --output dirs
    except OSError as exc:
        exc = ConfigError(f"--log-dir {log_dir}: cannot create it: {exc}")
        raise _not_submitted(exc, script, kept=args.output is not None) from None
    try:
        job_id = sbatch(script)
    except LaunchError as exc:
        raise _not_submitted(exc, script, kept=args.output is not None) from None
    print(f"[hpctrain] submitted {script} as job {job_id}", file=sys.stderr)
    print(job_id)
    return 0
