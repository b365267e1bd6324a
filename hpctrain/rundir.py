"""One run per run directory: reusing a directory is a decision, never an accident.

A directory that already holds a run (checkpoints, a non-empty metrics.jsonl or
TensorBoard events) is refused unless the user says what to do with it:
- `--resume auto` continues it, only when the previous run's config.yaml matches
  this one on the keys that decide what a checkpoint means (IDENTITY_KEYS); otherwise
  the refusal names the keys that differ. A run that stopped before its first
  checkpoint (e.g. requeued early) restarts from step 0 in the same directory.
- `--resume FILE` continues from that file (the user chose it; no config check).
- `--overwrite` clears the previous run's checkpoints, metrics and TensorBoard events.
- `--new` moves them into <run-dir>/previous/<UTC time>/ and starts afresh.
The synthetic data cache (<run-dir>/data/) is kept in every case.

A run refused before it wrote anything (a missing data file, a model that does not fit)
leaves no empty run directory behind: `make_run_dir` records what it created and
`remove_unused_run_dir` takes back whatever of that still holds no file.

Framework-free and MPI-free: rank 0 calls `plan_run_dir` and `apply_plan`, the caller
agrees the outcome over ranks. Cost: a directory listing and one small YAML read on
one rank, whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from .checkpoint.format import NAME_RE, TEMP_RE
from .errors import ConfigError

# What a checkpoint means: a run resumed with other values here would load weights into
# another model, read another file, or shuffle another permutation mid-epoch.
IDENTITY_KEYS = ("model", "data", "optimizer.name", "train.seed")
IGNORED_KEYS = ("data.inferred", "data.prefetch")  # facts written by hpctrain, speed knobs
SHOWN_DIFFERENCES = 3
RUN_FILES = ("metrics.jsonl", "config.yaml")
RUN_DIRS = ("tb",)


@dataclass(frozen=True)
class PreviousRun:
    """What an earlier run left in the directory."""

    run_dir: Path
    checkpoint_dir: Path
    checkpoints: tuple[Path, ...]
    metrics_lines: int
    tensorboard: bool
    config: dict | None

    @property
    def exists(self) -> bool:
        return bool(self.checkpoints or self.metrics_lines or self.tensorboard)

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            newest = NAME_RE.match(self.checkpoints[-1].name).group(1)
            parts.append(f"{len(self.checkpoints)} checkpoint(s) up to step {int(newest)}")
        if self.metrics_lines:
            parts.append(f"metrics.jsonl with {self.metrics_lines} line(s)")
        if self.tensorboard:
            parts.append("TensorBoard events")
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class RunDirPlan:
    """What to do with the directory: action in fresh | resume | overwrite | new."""

    action: str
    message: str
    remove: tuple[Path, ...] = ()
    archive_to: Path | None = None


def _checkpoint_dir(run_dir: Path, checkpoint_dir: str | Path | None) -> Path:
    return Path(checkpoint_dir) if checkpoint_dir else run_dir / "checkpoints"


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def find_previous_run(run_dir: str | Path, checkpoint_dir: str | Path | None = None) -> PreviousRun:
    """Look into `run_dir` (and the checkpoint directory) for an earlier run."""
    run_dir = Path(run_dir)
    ckpt_dir = _checkpoint_dir(run_dir, checkpoint_dir)
    checkpoints = ()
    if ckpt_dir.is_dir():
        checkpoints = tuple(sorted(p for p in ckpt_dir.iterdir() if NAME_RE.match(p.name)))
    tb = run_dir / "tb"
    config = None
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            config = {}
    return PreviousRun(
        run_dir,
        ckpt_dir,
        checkpoints,
        _count_lines(run_dir / "metrics.jsonl"),
        tb.is_dir() and any(tb.iterdir()),
        config if isinstance(config, dict) or config is None else {},
    )


def _flatten(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, full + "."))
        else:
            out[full] = value
    return out


def _identity(config: dict) -> dict:
    flat = _flatten(config)
    return {
        k: v
        for k, v in flat.items()
        if any(k == i or k.startswith(i + ".") for i in IDENTITY_KEYS)
        and not any(k == i or k.startswith(i + ".") for i in IGNORED_KEYS)
    }


def config_differences(previous: dict, current: dict) -> list[str]:
    """'key: X there, Y now' for every identity key that differs (sorted by key)."""
    old, new = _identity(previous), _identity(current)
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {_show(old.get(key))} there, {_show(new.get(key))} now")
    return out


def _show(value) -> str:
    if value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value)


def plan_run_dir(
    run_dir: str | Path,
    config: dict,
    resume: str | None = None,
    overwrite: bool = False,
    new: bool = False,
    checkpoint_dir: str | Path | None = None,
) -> RunDirPlan:
    """Decide what this run does with `run_dir`; ConfigError (one line) when refused.

    config: this run's configuration as a dict (Config.to_dict()). resume: None or
    'never', 'auto', or a checkpoint file. checkpoint_dir: checkpoint.dir (None:
    <run-dir>/checkpoints).
    """
    run_dir = Path(run_dir)
    resume = None if resume in (None, "", "never") else resume
    if overwrite and new:
        raise ConfigError("--overwrite and --new contradict each other: choose one")
    if (overwrite or new) and resume is not None:
        flag = "--overwrite" if overwrite else "--new"
        raise ConfigError(f"{flag} and --resume {resume} contradict each other: choose one")
    prev = find_previous_run(run_dir, checkpoint_dir)
    if not prev.exists:
        if resume == "auto":
            return RunDirPlan("fresh", f"--resume auto: nothing to resume in {run_dir}, starting")
        return RunDirPlan("resume" if resume else "fresh", f"run directory {run_dir}")
    there = f"{run_dir} already holds a run ({prev.describe()})"
    if overwrite:
        return RunDirPlan("overwrite", f"--overwrite: clearing {there}", _run_outputs(prev))
    if new:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = run_dir / "previous" / stamp
        return RunDirPlan(
            "new", f"--new: moving the earlier run to {target}", _run_outputs(prev), target
        )
    if resume is None:
        raise ConfigError(
            f"{there}: pass --resume auto to continue it, --overwrite to replace it, --new "
            "to keep it under previous/ and start afresh, or choose another --run-dir"
        )
    if resume != "auto":
        return RunDirPlan("resume", f"resuming from {resume} in {run_dir}")
    if prev.config is None:
        raise ConfigError(
            f"--resume auto: {there} but no config.yaml, so hpctrain cannot tell whether "
            "it is this run; pass --resume FILE, --overwrite or another --run-dir"
        )
    differences = config_differences(prev.config, config)
    if differences:
        shown = "; ".join(differences[:SHOWN_DIFFERENCES])
        more = len(differences) - SHOWN_DIFFERENCES
        shown += f"; and {more} more" if more > 0 else ""
        raise ConfigError(
            f"--resume auto: {there} with another configuration ({shown}): use another "
            "--run-dir, --new or --overwrite, or resume that run with its own config.yaml"
        )
    if not prev.checkpoints:
        return RunDirPlan(
            "fresh",
            f"--resume auto: {run_dir} holds the same run without a checkpoint yet "
            f"({prev.describe()}): starting at step 0",
        )
    return RunDirPlan("resume", f"--resume auto: continuing the run in {run_dir}")


def _run_outputs(prev: PreviousRun) -> tuple[Path, ...]:
    paths = [p for p in (prev.run_dir / name for name in RUN_FILES) if p.exists()]
    paths += [p for p in (prev.run_dir / name for name in RUN_DIRS) if p.exists()]
    if prev.checkpoint_dir.is_dir():
        paths += [
            p
            for p in sorted(prev.checkpoint_dir.iterdir())
            if NAME_RE.match(p.name) or TEMP_RE.match(p.name)
        ]
    return tuple(paths)


def apply_plan(plan: RunDirPlan) -> None:
    """Clear (--overwrite) or move away (--new) the earlier run; call on one rank only."""
    for path in plan.remove:
        if plan.archive_to is not None:
            target = plan.archive_to / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, target)  # the checkpoint directory may be on another file system
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


# The directories this process created for its run (deepest first), until it starts.
_created: list[Path] = []


def make_run_dir(run_dir: str | Path) -> None:
    """`mkdir -p run_dir` (rank 0), remembering which directories this created."""
    run_dir = Path(run_dir)
    missing = []
    for d in (run_dir, *run_dir.parents):
        if d.exists():
            break
        missing.append(d)
    run_dir.mkdir(parents=True, exist_ok=True)
    _created[:] = missing


def remove_unused_run_dir() -> list[Path]:
    """After a refusal: remove the directories `make_run_dir` created, and the empty
    directories under them, as long as they hold no file (nothing is ever deleted but
    empty directories). Returns the directories removed; forgets what it recorded."""
    removed: list[Path] = []
    created, _created[:] = list(_created), []
    if not created:
        return removed
    for root, _dirs, _files in os.walk(created[0], topdown=False):
        if Path(root) == created[0]:
            continue
        try:
            os.rmdir(root)
            removed.append(Path(root))
        except OSError:
            pass
    for d in created:  # deepest first: a parent only goes when its child went
        try:
            d.rmdir()
        except OSError:
            break
        removed.append(d)
    return removed


def keep_run_dir() -> None:
    """The run started: what it created is its own from here on."""
    _created.clear()
