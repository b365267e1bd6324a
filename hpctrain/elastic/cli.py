"""`hpctrain elastic`: run a training job that restarts itself after a failure."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from .hosts import allocation_hosts, read_hostfile
from .supervisor import Options, Supervisor

EPILOG = """\
example (run it where a batch script would run mpirun):
  hpctrain elastic --hostfile hosts --np 2:8 --max-restarts 3 -- \\
      train --config configs/demo.yaml --run-dir runs/demo
  Each attempt is `mpirun --hostfile <hosts that answer> -np N [--mpirun-args]
  hpctrain train ... --resume auto`. Inside a SLURM allocation (sbatch script):
  hpctrain elastic --launcher srun --launcher-args=--mpi=pmix -- train ...
  runs each attempt as `srun --nodes=K --ntasks=N --nodelist=<nodes that answer>`. The global batch stays as launched (grad_accum
  absorbs lost replicas) where it divides; events in <run-dir>/elastic/events.jsonl.
"""


def register(sub) -> dict:
    p = sub.add_parser(
        "elastic",
        help="train with restarts: relaunch from the newest checkpoint on the hosts left",
        description="Launch `hpctrain train` with mpirun over the hosts of --hostfile and, "
        "when the job fails or one of its hosts stops answering, probe the hosts, leave "
        "out the ones that do not answer and relaunch from the newest checkpoint that "
        "verifies, at a world size within --np, at most --max-restarts times.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--launcher",
        choices=("mpirun", "srun"),
        default="mpirun",
        help="mpirun (default), or srun: each attempt is a job step of the SLURM allocation "
        "this runs in (sbatch/salloc), on its nodes that still answer",
    )
    p.add_argument(
        "--hostfile",
        default=None,
        help="Open MPI hostfile: `host slots=N` lines (mpirun: required; srun: default the "
        "allocation's nodes and tasks per node)",
    )
    p.add_argument(
        "--np",
        default=None,
        metavar="MIN:MAX",
        help="world sizes allowed (default 1:<all slots>); MAX caps the first launch",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restart budget (0: never restart; default 3)"
    )
    p.add_argument(
        "--mpirun-args",
        "--launcher-args",
        dest="mpirun_args",
        default="",
        metavar="ARGS",
        help="more launcher arguments, one shell-quoted string (mpirun: e.g. "
        '--mpirun-args "--mca btl self,vader,tcp"; srun: --launcher-args=--mpi=pmix, with '
        "the = when the string starts with a dash and holds no space)",
    )
    p.add_argument(
        "--rsh-agent",
        default=None,
        metavar="CMD",
        help="also probe each host with `CMD HOST true` (default: mpirun's plm_rsh_agent "
        "from --mpirun-args, else none)",
    )
    p.add_argument(
        "--probe-port", type=int, default=22, help="TCP port probed on each host (default 22)"
    )
    p.add_argument("--probe-timeout", type=float, default=5.0, help="seconds per probe (default 5)")
    p.add_argument(
        "--watch-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="probe the running job's hosts this often (TCP; those that answer as it "
        "starts); a host that misses two probes in a row ends the attempt, which is "
        "restarted without it (default 30; 0: only after a failure). srun alone would "
        "wait for SLURM's SlurmdTimeout",
    )
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- train [train options]")
    return {"elastic": run}


def _train_options(words: list[str]):
    """The `train` options the supervisor needs; the rest passes through untouched."""
    t = argparse.ArgumentParser(prog="hpctrain elastic -- train", add_help=False)
    t.add_argument("--config", "-c")
    t.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    t.add_argument("--run-dir")
    t.add_argument("--resume")
    t.add_argument("--new", action="store_true")
    t.add_argument("--overwrite", action="store_true")
    known, _ = t.parse_known_args(words)
    return known


def _without_reuse_flags(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("--new", "--overwrite"):
            continue
        if w == "--resume":
            skip = True
            continue
        if w.startswith("--resume="):
            continue
        out.append(w)
    return out


REUSE_FLAGS = ("--new", "--overwrite", "--resume")


def _check_start(args, words: list[str], run_dir: Path) -> None:
    """What would otherwise fail only at the first launch or the first restart."""
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts must be 0 or more")
    if not (0 < args.probe_timeout < float("inf")):
        raise ConfigError(f"--probe-timeout {args.probe_timeout:g}: give seconds above 0")
    if not (0 <= args.watch_interval < float("inf")):
        raise ConfigError(f"--watch-interval {args.watch_interval:g}: give seconds, 0 or more")
    if not 0 < args.probe_port < 65536:
        raise ConfigError(f"--probe-port {args.probe_port}: not a TCP port (1-65535)")
    if shutil.which(args.launcher) is None:
        raise ConfigError(
            f"hpctrain elastic: {args.launcher} not found on PATH (--launcher {args.launcher})"
        )
    for word in words:  # restarts replace these flags, so they must be recognisable
        name = word.split("=", 1)[0]
        full = [f for f in REUSE_FLAGS if f.startswith(name)]
        if len(name) > 2 and name.startswith("--") and full and name not in REUSE_FLAGS:
            raise ConfigError(f"hpctrain elastic: write {full[0]} in full, not {name}")
    there = next((d for d in (run_dir, *run_dir.absolute().parents) if d.exists()), None)
    if there is not None and not there.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {there} is not a directory")


def _np_range(text: str | None) -> tuple[int, int | None]:
    if text is None:
        return 1, None
    lo, sep, hi = text.partition(":")
    try:
        np_min = int(lo) if lo else 1
        np_max = int(hi) if sep and hi else (None if sep else np_min)
    except ValueError:
        raise ConfigError(f"--np {text}: expected MIN:MAX, e.g. 2:8") from None
    if np_min < 1 or (np_max is not None and np_max < np_min):
        raise ConfigError(f"--np {text}: need 1 <= MIN <= MAX")
    return np_min, np_max


def _split(option: str, text: str) -> list[str]:
    """`text` split as the shell would, or a ConfigError naming `option` (an unbalanced
    quote, a trailing backslash)."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ConfigError(
            f"{option} {text!r}: {str(exc).lower()}: expected one shell-quoted string "
            "(every quote closed, no trailing backslash)"
        ) from None


def _hpctrain_command() -> list[str]:
    beside = Path(sys.executable).parent / "hpctrain"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("hpctrain")
    return [found] if found else [sys.executable, "-m", "hpctrain"]


def _hosts(args):
    if args.hostfile:
        return read_hostfile(args.hostfile)
    if args.launcher == "srun":
        return allocation_hosts(dict(os.environ))
    raise ConfigError("hpctrain elastic: --hostfile is required with mpirun")


def run(args) -> int:
    words = list(args.train)
    if words and words[0] == "--":
        words = words[1:]
    if not words or words[0] != "train":
        raise ConfigError("hpctrain elastic: give the job after `--`: -- train [options]")
    t = _train_options(words[1:])
    if not t.run_dir:
        raise ConfigError(
            "hpctrain elastic: the job needs --run-dir, so that every restart finds its checkpoints"
        )
    cfg = Config.load(t.config, t.overrides)
    if not cfg.checkpoint["enabled"]:
        raise ConfigError(
            "hpctrain elastic restarts from checkpoints, but checkpoint.enabled is false"
        )
    option = "--launcher-args" if args.launcher == "srun" else "--mpirun-args"
    mpirun_args = _split(option, args.mpirun_args)
    agent = _split("--rsh-agent", args.rsh_agent) if args.rsh_agent else None
    if agent is None and "plm_rsh_agent" in mpirun_args:
        i = mpirun_args.index("plm_rsh_agent")
        if i + 1 < len(mpirun_args):
            agent = _split(f"{option} plm_rsh_agent", mpirun_args[i + 1])
    _check_start(args, words, Path(t.run_dir))
    np_min, np_max = _np_range(args.np)
    first = []
    if t.resume:
        first = ["--resume", t.resume]
    elif t.new:
        first = ["--new"]
    elif t.overwrite:
        first = ["--overwrite"]
    opts = Options(
        train_args=_without_reuse_flags(words),
        first_flags=first,
        run_dir=Path(t.run_dir),
        hosts=_hosts(args),
        launcher=args.launcher,
        np_min=np_min,
        np_max=np_max,
        max_restarts=args.max_restarts,
        mpirun_args=mpirun_args,
        agent=agent,
        probe_port=args.probe_port,
        probe_timeout=args.probe_timeout,
        watch_interval=args.watch_interval,
        hpctrain=_hpctrain_command(),
    )
    return Supervisor(opts, cfg).run()
