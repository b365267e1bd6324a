"""One run per run directory: reusing a directory is a decision, never an accident.

A directory that already holds a run (checkpoints, a non-empty metrics.jsonl or
TensorBoard events) is refused unless the user says what to do with it:
- `--resume auto` continues it, only when the previous run's config.yaml matches
  this one on the keys that decide what a checkpoint means (IDENTITY_KEYS); otherwise
  the refusal names the keys that differ. A run that stopped before its first
  checkpoint (e.g. requeued early) restarts from step 0 in the same directory.
- `--resume FILE` continues from that file (the user chose it; no config check).
- `--overwrite` clears the previous run's checkpoints (with their per-rank shard
  directories), metrics.jsonl, config.yaml and TensorBoard event files.
- `--new` moves them into <run-dir>/previous/<UTC time>/ and starts afresh.
The synthetic data cache (<run-dir>/data/) and any file hpctrain did not write (a user's
notes in tb/, say) are kept in every case.

Nothing of another run is touched: a config.yaml hpctrain did not write (it writes a
header line; an earlier version's is exactly the YAML dump of a whole configuration)
makes the directory refused whatever the flags, and a `checkpoint.dir`
outside the run directory records its run (CHECKPOINT_OWNER): a run in another
directory pointed at it is refused before it reads, moves or deletes anything there.

A run refused before it started (a missing data file, a model that does not fit) leaves
no run directory behind that it created: `make_run_dir` records what it created and
`remove_unused_run_dir` takes back whatever of that holds no file but the synthetic data
cache this attempt wrote there.

Framework-free and MPI-free: rank 0 calls `plan_run_dir` and `apply_plan`, the caller
agrees the outcome over ranks. Cost: a directory listing and one small YAML read on
one rank, whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from .checkpoint.format import (
    NAME_RE,
    SHARDS_RE,
    TEMP_RE,
    set_aside_dir,
    starts_as_checkpoint,
    step_of_entry,
)
from .checkpoint.model_match import MOE_RESUMABLE, RESUMABLE
from .checkpoint.sharded import remove_shard_folder
from .data.synthetic import SYNTHETIC_PREFIX
from .errors import ConfigError
from .models.zoo import written_model

# What a checkpoint means: a run resumed with other values here would load weights into
# another model, read another file, or shuffle another permutation mid-epoch.
IDENTITY_KEYS = ("model", "data", "optimizer.name", "train.seed")
IGNORED_KEYS = (  # facts written by hpctrain, speed knobs, and the model's options that a
    # checkpoint resumes across (checkpoint/model_match.py: the loader's own rule)
    "data.inferred",
    "data.prefetch",
    *(f"model.{k}" for k in RESUMABLE),
    *(f"model.moe.{k}" for k in MOE_RESUMABLE),
)
SHOWN_DIFFERENCES = 3
RUN_FILES = ("metrics.jsonl", "config.yaml")
TB_EVENTS = "events.out.tfevents."  # TensorBoard's event files (tb/); nothing else in tb/
# The first line of the config.yaml a run writes: a config.yaml without it is the user's.
CONFIG_HEADER = "# Written by hpctrain: the configuration of the run in this directory.\n"
# The sections every version's whole configuration has: an earlier version's config.yaml
# (no header) was their dump. A user's short file in the same form is not a run's.
LEGACY_SECTIONS = frozenset(
    ("backend", "strategy", "model", "data", "optimizer", "train", "horovod", "runtime", "metrics")
)
# In a checkpoint.dir outside the run directory: the run directory whose checkpoints these are.
DEFAULT_CHECKPOINTS = "checkpoints"  # <run-dir>/checkpoints unless checkpoint.dir
CHECKPOINT_OWNER = ".hpctrain-run"


@dataclass(frozen=True)
class PreviousRun:
    """What an earlier run left in the directory."""

    run_dir: Path
    checkpoint_dir: Path
    checkpoints: tuple[Path, ...]
    metrics_lines: int
    tensorboard: bool
    config: dict | None
    config_problem: str | None = None  # why config.yaml is not an hpctrain run's
    owner: Path | None = None  # CHECKPOINT_OWNER of a checkpoint.dir outside the run dir

    @property
    def exists(self) -> bool:
        return bool(self.checkpoints or self.metrics_lines or self.tensorboard)

    @property
    def outside(self) -> bool:
        """The checkpoints live outside the run directory (checkpoint.dir)."""
        return not _inside(self.checkpoint_dir, self.run_dir)

    @property
    def newest_step(self) -> int | None:
        """The step of the newest checkpoint file (by name; not verified), or None."""
        return _step_in_name(self.checkpoints[-1]) if self.checkpoints else None

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            where = f" in {self.checkpoint_dir}" if self.outside else ""
            parts.append(
                f"{len(self.checkpoints)} checkpoint(s) up to step {self.newest_step}{where}"
            )
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
    resume: str | None = None  # the --resume to use instead of the one given (a requeue)


def _checkpoint_dir(run_dir: Path, checkpoint_dir: str | Path | None) -> Path:
    return Path(checkpoint_dir) if checkpoint_dir else run_dir / DEFAULT_CHECKPOINTS


def _inside(path: Path, parent: Path) -> bool:
    return path.resolve().is_relative_to(parent.resolve())


def _tb_events(run_dir: Path) -> list[Path]:
    tb = run_dir / "tb"
    return sorted(p for p in tb.iterdir() if p.name.startswith(TB_EVENTS)) if tb.is_dir() else []


def _read_config(path: Path) -> tuple[dict | None, str | None]:
    """(the config.yaml's values or None, why it is not hpctrain's or None). hpctrain's
    has its header line, or (an earlier version's) is exactly the YAML dump of a whole
    configuration; a file a user wrote (comments, another key order, a few keys) is not."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return {}, f"cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return {}, "was not written by hpctrain (it is not UTF-8 text)"
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError:
        values = None
    if not isinstance(values, dict):
        return {}, "was not written by hpctrain (it is not a mapping of keys)"
    if text.startswith(CONFIG_HEADER):
        return values, None
    if values.keys() >= LEGACY_SECTIONS and text == yaml.safe_dump(values, sort_keys=True):
        return values, None
    return values, "was not written by hpctrain (it has no header line)"


def read_owner(checkpoint_dir: Path) -> Path | None:
    """The run directory recorded in a checkpoint.dir outside it (None: none recorded)."""
    text = (_marker_text(Path(checkpoint_dir) / CHECKPOINT_OWNER) or "").strip()
    return Path(text) if text else None


def _another_runs(owner: Path | None, run_dir: Path) -> bool:
    """A recorded owner that is another run directory, still there (one moved away
    leaves its checkpoints to its successor)."""
    return owner is not None and owner.resolve() != run_dir.resolve() and owner.is_dir()


def claim_checkpoint_dir(run_dir: str | Path, checkpoint_dir: str | Path | None) -> None:
    """Record in a checkpoint.dir outside the run directory that its checkpoints are this
    run's (rank 0, once the run directory is claimed); nothing for the default one. A run
    refused before it starts takes the claim back (remove_unused_run_dir)."""
    run_dir, ckpt_dir = Path(run_dir), _checkpoint_dir(Path(run_dir), checkpoint_dir)
    if _inside(ckpt_dir, run_dir):
        return
    marker = ckpt_dir / CHECKPOINT_OWNER
    missing = [d for d in (ckpt_dir, *ckpt_dir.parents) if not d.exists()]
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise ConfigError(f"checkpoint.dir {ckpt_dir} is a file, not a directory")
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on its path, say: the option, not the run directory
        raise ConfigError(f"checkpoint.dir {ckpt_dir}: {exc.strerror or exc}") from None
    here, temp = run_dir.resolve(), ckpt_dir / f"{CHECKPOINT_OWNER}.tmp-{os.getpid()}"
    temp.write_text(f"{here}\n")
    try:  # whole or not at all, and only if no run claimed it first (an array job's tasks)
        before = None if _link_exclusive(temp, marker) else _marker_text(marker)
        if before is not None:
            owner = Path(before.strip()) if before.strip() else None
            if owner is None or _another_runs(owner, here):
                raise ConfigError(
                    f"checkpoint.dir {ckpt_dir} is claimed by "
                    f"{f'the run in {owner}' if owner else 'a run it cannot name'} (its "
                    f"{CHECKPOINT_OWNER}): give this run its own checkpoint.dir "
                    "(--set checkpoint.dir=...)"
                )
            if owner.resolve() != here:  # its run directory was moved away: adopt
                os.replace(temp, marker)
    finally:
        temp.unlink(missing_ok=True)
    _claimed[:] = [(marker, before, missing)]


def _link_exclusive(temp: Path, marker: Path) -> bool:
    """Make `marker` `temp`'s content unless it exists (True if made): a hard link never
    shows a half-written file; where links are not allowed, an exclusive create."""
    try:
        os.link(temp, marker)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links
        try:
            with open(marker, "x") as f:
                f.write(temp.read_text())
            return True
        except FileExistsError:
            return False


def _marker_text(marker: Path) -> str | None:
    try:
        return marker.read_text()
    except OSError:
        return None


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
    config, problem = _read_config(run_dir / "config.yaml")
    inside = _inside(ckpt_dir, run_dir)
    return PreviousRun(
        run_dir,
        ckpt_dir,
        checkpoints,
        _count_lines(run_dir / "metrics.jsonl"),
        bool(_tb_events(run_dir)),
        config,
        config_problem=problem,
        owner=None if inside else read_owner(ckpt_dir),
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
    if isinstance(config.get("model"), dict):  # earlier runs wrote only the options given
        config = {**config, "model": written_model(config["model"])}
    flat = _flatten(config)
    return {
        k: v
        for k, v in flat.items()
        if any(k == i or k.startswith(i + ".") for i in IDENTITY_KEYS)
        and not any(k == i or k.startswith(i + ".") for i in IGNORED_KEYS)
    }


def config_differences(previous: dict, current: dict) -> list[str]:
    """'key: X there, Y now' for every identity key that differs (sorted by key, the
    model's name first: another model differs in all its options)."""
    old, new = _identity(previous), _identity(current)
    out = []
    for key in sorted(set(old) | set(new), key=lambda k: (k != "model.name", k)):
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
    requeued: bool = False,
    resume_option: str = "--resume",
) -> RunDirPlan:
    """Decide what this run does with `run_dir`; ConfigError (one line) when refused.

    config: this run's configuration as a dict (Config.to_dict()). resume: None or
    'never', 'auto', or a checkpoint file. checkpoint_dir: checkpoint.dir (None:
    <run-dir>/checkpoints). requeued: a requeued job runs its first command line again
    (SLURM_RESTART_COUNT > 0); a --resume FILE then gives way to the run's own newer
    checkpoints (`--resume auto`) instead of going back to FILE every time.
    resume_option: where `resume` was set, for the refusals (`checkpoint.resume` when
    the configuration set it).

    --resume FILE on a run that holds later checkpoints abandons them: they move to
    <run-dir>/previous/<UTC>/ (a later --resume auto and keep_last see one timeline).
    """
    run_dir = Path(run_dir)
    resume = None if resume in (None, "", "never") else resume
    _refuse_contradictions(resume, overwrite, new, resume_option)
    prev = find_previous_run(run_dir, checkpoint_dir)
    _refuse_what_is_not_this_runs(prev, resume)
    _refuse_what_is_only_named_like_a_checkpoint(prev, resume)
    if not prev.exists:
        if resume == "auto":
            return RunDirPlan("fresh", f"--resume auto: nothing to resume in {run_dir}, starting")
        return RunDirPlan("resume" if resume else "fresh", f"run directory {run_dir}")
    there = f"{run_dir} already holds a run ({prev.describe()})"
    if overwrite:
        return _overwrite(prev)
    if new:
        target = set_aside_dir(run_dir)
        return RunDirPlan(
            "new", f"--new: moving the earlier run to {target}", _run_outputs(prev), target
        )
    if resume is None:
        raise ConfigError(
            f"{there}: pass --resume auto to continue it, --overwrite to replace it, --new "
            "to keep it under previous/ and start afresh, or choose another --run-dir"
        )
    note, chosen = _requeued_resume(prev, resume, requeued)
    resume = chosen or resume
    shown = _differences_text(prev, config)
    if resume != "auto":
        if shown:  # its checkpoints would be pruned as this run's, config.yaml replaced
            raise ConfigError(
                f"--resume {resume}: {there} with another configuration ({shown}): resume "
                "into another --run-dir (the file is read from anywhere), or move that run "
                "away first"
            )
        return _resume_from_file(prev, Path(resume))
    if prev.config is None:
        raise ConfigError(
            f"--resume auto: {there} but no config.yaml, so hpctrain cannot tell whether "
            "it is this run; pass --resume FILE, --overwrite or another --run-dir"
        )
    if shown:
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
    return RunDirPlan(
        "resume", f"{note}--resume auto: continuing the run in {run_dir}", resume=chosen
    )


def _refuse_contradictions(resume, overwrite: bool, new: bool, resume_option: str) -> None:
    """What the options alone rule out, before anything is read."""
    if overwrite and new:
        raise ConfigError("--overwrite and --new contradict each other: choose one")
    asked = f"{resume_option}{' ' if resume_option.startswith('--') else '='}{resume}"
    if (overwrite or new) and resume is not None:
        flag = "--overwrite" if overwrite else "--new"
        raise ConfigError(f"{flag} and {asked} contradict each other: choose one")
    if resume not in (None, "auto") and not Path(resume).is_file():  # before any data
        what = "is a directory" if Path(resume).is_dir() else "no such checkpoint file"
        raise ConfigError(f"{asked}: {what}; it takes a ckpt-<step>.h5, auto or never")


def _differences_text(prev: PreviousRun, config: dict) -> str:
    """The first few identity keys the earlier run's config.yaml and this one differ in
    ('' when the same, or when there is no config.yaml to compare with)."""
    differences = config_differences(prev.config, config) if prev.config is not None else []
    shown = "; ".join(differences[:SHOWN_DIFFERENCES])
    more = len(differences) - SHOWN_DIFFERENCES
    return shown + (f"; and {more} more" if more > 0 else "")


def _requeued_resume(prev: PreviousRun, resume: str, requeued: bool) -> tuple[str, str | None]:
    """A requeued job's --resume FILE gives way to the run's checkpoints from FILE's step
    on: (a note for the message, "auto"), or ("", None) to keep FILE."""
    if resume == "auto" or not requeued or not prev.checkpoints:
        return "", None
    if _step_in_name(prev.checkpoints[-1]) < _step_in_name(Path(resume)):
        return "", None
    return f"requeued: the run's own checkpoints, not --resume {resume} again; ", "auto"


def _step_in_name(path: Path) -> int:
    """The step a ckpt-<step>.h5 (or .shards) name says; -1 for any other name."""
    step = step_of_entry(path.name)
    return -1 if step is None else step


def _resume_from_file(prev: PreviousRun, chosen: Path) -> RunDirPlan:
    """--resume FILE: the run's checkpoints after FILE's step belong to the timeline it
    leaves; they move aside (never deleted). FILE's step is its name's, or for a copy
    named otherwise (best.h5) the one it records, read once it verifies (a damaged one
    moves nothing: the run refuses it)."""
    run_dir, step = prev.run_dir, _step_in_name(chosen)
    if step < 0:
        from .checkpoint.reader import verify
        from .errors import CheckpointError

        with contextlib.suppress(CheckpointError):
            step = verify(chosen).step
    later = []
    if step >= 0 and prev.checkpoint_dir.is_dir():
        later = [
            p
            for p in sorted(prev.checkpoint_dir.iterdir())
            if _step_in_name(p) > step and p.resolve() != chosen.resolve()
        ]
    if not later:
        return RunDirPlan("resume", f"resuming from {chosen} in {run_dir}")
    target = set_aside_dir(run_dir)
    steps = sorted({_step_in_name(p) for p in later})
    return RunDirPlan(
        "resume",
        f"resuming from {chosen} in {run_dir}: the {len(steps)} later checkpoint(s) of the "
        f"timeline it leaves (steps {steps[0]}-{steps[-1]}) move to {target}",
        tuple(later),
        target,
    )


def _refuse_what_is_not_this_runs(prev: PreviousRun, resume: str | None) -> None:
    """ConfigError when going on would overwrite a user's config.yaml, or read, rotate,
    move or delete checkpoints that another run directory recorded as its own."""
    if prev.config_problem:
        raise ConfigError(
            f"{prev.run_dir / 'config.yaml'} {prev.config_problem}, and a run writes its "
            "configuration there: move that file (pass it with --config from elsewhere) or "
            "choose another --run-dir"
        )
    if not prev.outside:
        return
    ckpt, owner = prev.checkpoint_dir, prev.owner
    if _another_runs(owner, prev.run_dir):
        raise ConfigError(
            f"checkpoint.dir {ckpt} belongs to the run in {owner} ({len(prev.checkpoints)} "
            f"checkpoint(s) there; its {CHECKPOINT_OWNER} says so): give this run its own "
            f"checkpoint.dir (--set checkpoint.dir=...), or use --run-dir {owner} to "
            "continue or replace that run"
        )
    # a run records itself in a checkpoint.dir outside its directory (claim_checkpoint_dir)
    # before it writes there: unrecorded checkpoints are another run's (its default
    # <run-dir>/checkpoints, say), whatever this run directory holds
    here = prev.run_dir.resolve()
    moved = owner is not None and owner.resolve() != here
    if moved and prev.checkpoints and not (prev.run_dir / "config.yaml").is_file():
        # the recorded run directory is gone, and this one holds no run: not its new name
        raise ConfigError(
            f"checkpoint.dir {ckpt} holds {len(prev.checkpoints)} checkpoint(s) of the run "
            f"recorded in {owner} (its {CHECKPOINT_OWNER}), which is no longer there: if "
            "that run moved, pass its new directory as --run-dir; otherwise give this run "
            "its own checkpoint.dir (--set checkpoint.dir=...)"
        )
    if not prev.checkpoints or owner is not None:
        return
    newest = prev.newest_step
    holder = ckpt.parent if (ckpt.parent / "config.yaml").is_file() else None
    if holder is not None and ckpt.name == DEFAULT_CHECKPOINTS:
        # another run's own <run-dir>/checkpoints: never written into, whatever --resume
        # says (this run would prune that run's checkpoints and mix its timeline in)
        raise ConfigError(
            f"checkpoint.dir {ckpt} holds {len(prev.checkpoints)} checkpoint(s) up to step "
            f"{newest} that the run in {holder} wrote (its <run-dir>/checkpoints): give "
            "this run its own checkpoint.dir (--set checkpoint.dir=...); to start from one "
            "of them, --resume FILE reads it from there"
        )
    if resume is None or resume == "auto":
        raise ConfigError(
            f"checkpoint.dir {ckpt} holds {len(prev.checkpoints)} checkpoint(s) up to step "
            f"{newest} that no run in {prev.run_dir} recorded as its own (no "
            f"{CHECKPOINT_OWNER}): to start from one and leave them all as they are, "
            "give this run its own checkpoint.dir (--set checkpoint.dir=...) and --resume "
            "FILE; --resume FILE alone makes them this run's (later ones move to "
            "previous/, and checkpoint.keep_last prunes the rest as the run saves)"
        )


def _refuse_what_is_only_named_like_a_checkpoint(prev: PreviousRun, resume: str | None) -> None:
    """A file (or directory) in checkpoint.dir named like a checkpoint that does not
    begin with hpctrain's header: hpctrain saves, prunes, moves and resumes by those
    names, so the run's save of that step would replace it, and --resume auto found no
    checkpoint that verifies while --new and --overwrite left it. Refused, naming it,
    except under --resume auto beside checkpoints that do begin with the header: auto
    then sets the newer odd ones aside with the damaged (previous/) and never writes an
    older step again. Cost: 20 bytes read per checkpoint file, on one rank."""
    present = [p for p in prev.checkpoints if os.path.lexists(p)]  # pruned meanwhile: gone
    found = [p for p in present if not (p.is_file() and starts_as_checkpoint(p))]
    if not found or (resume == "auto" and len(found) < len(present)):
        return
    names = ", ".join(p.name for p in found[:SHOWN_DIFFERENCES])
    more = f" and {len(found) - SHOWN_DIFFERENCES} more" if len(found) > SHOWN_DIFFERENCES else ""
    raise ConfigError(
        f"{prev.checkpoint_dir} holds {names}{more}, named like checkpoints but not beginning "
        "with hpctrain's checkpoint header (a file of your own, or a checkpoint damaged in "
        "its first bytes: `hpctrain ckpt verify` says which): hpctrain saves, prunes and "
        "resumes by these names, so move it out of the checkpoint directory first"
    )


def _overwrite(prev: PreviousRun) -> RunDirPlan:
    """Delete what the earlier run wrote. A run writes config.yaml before metrics.jsonl
    and its TensorBoard events: without one, those files are not known to be a run's."""
    if prev.config is not None or not (prev.metrics_lines or prev.tensorboard):
        return RunDirPlan(
            "overwrite",
            f"--overwrite: {prev.run_dir} holds an earlier run ({prev.describe()}): deleting "
            "what it wrote",
            _run_outputs(prev),
        )
    found = [
        what
        for what, on in (("metrics.jsonl", prev.metrics_lines), ("tb/ events", prev.tensorboard))
        if on
    ]
    raise ConfigError(
        f"--overwrite: {prev.run_dir} holds {' and '.join(found)} but no config.yaml, so "
        "hpctrain cannot tell they are a run's (a run writes config.yaml first): move them "
        "away, or choose another --run-dir"
    )


def _run_outputs(prev: PreviousRun) -> tuple[Path, ...]:
    """What --overwrite deletes and --new moves: hpctrain's files, never anything else."""
    paths = [p for p in (prev.run_dir / name for name in RUN_FILES) if p.exists()]
    paths += _tb_events(prev.run_dir)
    if prev.checkpoint_dir.is_dir():
        paths += [p for p in sorted(prev.checkpoint_dir.iterdir()) if _written_by_hpctrain(p)]
    return tuple(paths)


def _written_by_hpctrain(path: Path) -> bool:
    """A checkpoint or temp file, or a shard folder (whose members remove_shard_folder
    takes by hpctrain's names only): the names hpctrain gives them, as what it makes
    them. A checkpoint-named file without hpctrain's header never gets here: --new and
    --overwrite are refused beside one (_refuse_what_is_only_named_like_a_checkpoint)."""
    if SHARDS_RE.match(path.name):
        return path.is_dir()
    return bool(NAME_RE.match(path.name) or TEMP_RE.match(path.name)) and not path.is_dir()


def write_config_text(run_dir: Path, text: str) -> None:
    """<run-dir>/config.yaml, whole or not at all (a torn file, from a full disk or a
    crash, blocked every later run in the directory as not hpctrain's)."""
    target = Path(run_dir) / "config.yaml"
    temp = target.with_name(f".config.yaml.tmp-{os.getpid()}")
    try:
        temp.write_text(text)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def apply_plan(plan: RunDirPlan) -> None:
    """Clear (--overwrite) or move away (--new) the earlier run; call on one rank only."""
    for path in plan.remove:
        if plan.archive_to is not None:
            under_tb = path.parent.name == "tb" and path.name.startswith(TB_EVENTS)
            target = plan.archive_to / ("tb" if under_tb else "") / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, target)  # the checkpoint directory may be on another file system
        elif path.is_dir() and not path.is_symlink():  # a shard folder: hpctrain's files
            remove_shard_folder(path)
        else:  # a link goes, never its target
            path.unlink(missing_ok=True)
    tb_dirs = {p.parent for p in plan.remove if p.name.startswith(TB_EVENTS)}
    for tb in tb_dirs:  # tb/ goes only when it held nothing but TensorBoard's files
        with contextlib.suppress(OSError):
            tb.rmdir()


# The directories this process created for its run (deepest first), until it starts.
_created: list[Path] = []
# Its claim of a checkpoint.dir outside the run directory, until it starts: (the
# CHECKPOINT_OWNER file, its text before or None, the directories created for it).
_claimed: list[tuple[Path, str | None, list[Path]]] = []


def make_run_dir(run_dir: str | Path) -> None:
    """`mkdir -p run_dir` (rank 0), remembering which directories this created."""
    run_dir = Path(run_dir)
    for part in (run_dir, *run_dir.parents):  # mkdir's own error is "[Errno 17] File exists"
        if part.exists() and not part.is_dir():
            what = "it is" if part == run_dir else f"{part} is"
            raise ConfigError(f"--run-dir {run_dir}: {what} a file, not a directory")
    missing = _missing(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if missing or not _created or _created[0] != run_dir:  # keep make_new_run_dir's record
        _created[:] = missing


def make_new_run_dir(base: Path) -> Path:
    """Create `base`, or base-2, base-3, ... when it exists (an exclusive mkdir: two
    processes never get the same one); remembered as make_run_dir's are."""
    missing = _missing(base.parent)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        _created[:] = [candidate, *missing]
        return candidate
    raise AssertionError("unreachable")


def _missing(path: Path) -> list[Path]:
    """`path` and its parents that do not exist, deepest first."""
    missing = []
    for d in (path, *path.parents):
        if d.exists():
            break
        missing.append(d)
    return missing


def remove_unused_run_dir() -> list[Path]:
    """After a refusal: remove the directories `make_run_dir` created, and the empty
    directories under them, as long as they hold no file. The one file deleted is the
    synthetic data cache (data/synthetic-*.h5) of a run directory this process created:
    this attempt wrote it, in a directory that did not exist before. Returns the paths
    removed; forgets what it recorded."""
    removed: list[Path] = _take_back_claim()
    created, _created[:] = list(_created), []
    if not created:
        return removed
    for cache in sorted((created[0] / "data").glob(f"{SYNTHETIC_PREFIX}*.h5")):  # the run dir
        with contextlib.suppress(OSError):
            cache.unlink()
            removed.append(cache)
    for root, _dirs, _files in os.walk(created[0], topdown=False):
        if Path(root) == created[0]:
            continue
        try:
            os.rmdir(root)
            removed.append(Path(root))
        except OSError:
            pass
    return removed + _remove_empty(created)


def _remove_empty(dirs: list[Path]) -> list[Path]:
    """rmdir each of `dirs` (deepest first) while they are empty: a parent only goes when
    its child went. Returns those removed."""
    removed = []
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break
        removed.append(d)
    return removed


def _take_back_claim() -> list[Path]:
    """Undo claim_checkpoint_dir: the earlier owner's text back, or no file, and the
    directories made for it if they stayed empty."""
    removed: list[Path] = []
    for marker, before, missing in _claimed:
        with contextlib.suppress(OSError):
            if before is None:
                marker.unlink(missing_ok=True)
            else:
                marker.write_text(before)
        removed += _remove_empty(missing)
    _claimed.clear()
    return removed


def keep_run_dir() -> None:
    """The run started: what it created is its own from here on."""
    _created.clear()
    _claimed.clear()
