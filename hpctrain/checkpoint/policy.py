"""When to save and which checkpoints to keep, from the config's `checkpoint:` section.

Pure decisions, no I/O: `due()` answers "save now?" from the step, epoch end and wall
time; `to_delete()` picks the files outside "the last K plus the best K by a metric".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..fields import NONNEG, POS_INT, POSITIVE, Field, check_value, field

# The metrics `hpctrain train` records with a checkpoint (an epoch's), with the end of each
# that is best: a typo kept nothing (found in no checkpoint, every "best" one was pruned)
# and val_accuracy with best_mode min kept the worst. A library user's own metrics
# (`save(..., metrics=)`) are theirs to name.
BEST_MODES = {"val_loss": "min", "val_accuracy": "max", "loss": "min"}

# The `checkpoint:` section, declared once: the config schema takes it as it is (types,
# docs, `--set`), and CheckpointPolicy checks a section given to it directly (a library
# user's dict) with the same fields.
SCHEMA: dict[str, Field] = {
    "enabled": field(True, bool, "write checkpoints at all"),
    "dir": field(None, str, "checkpoint directory (default <run-dir>/checkpoints)", nullable=True),
    "every_steps": field(
        None,
        (int, str),
        "save every N optimizer steps; auto: the Young/Daly interval sqrt(2 x save stall "
        "x checkpoint.mtbf_hours), measured",
        nullable=True,
        **POS_INT,
    ),
    "mtbf_hours": field(
        24.0,
        (int, float),
        "mean time between failures of the job, for every_steps: auto",
        **POSITIVE,
    ),
    "every_minutes": field(
        30.0,
        (int, float),
        "save when N minutes passed since the last save",
        nullable=True,
        **POSITIVE,
    ),
    "at_epoch_end": field(True, bool, "save at the end of every epoch"),
    "keep_last": field(
        3, int, "keep the newest N checkpoints (null: keep all)", nullable=True, **POS_INT
    ),
    "keep_best": field(0, int, "also keep the best N by checkpoint.best_metric", **NONNEG),
    "best_metric": field(
        "val_loss",
        str,
        "metric that ranks checkpoints for keep_best (hpctrain train records val_loss, "
        "val_accuracy and loss)",
    ),
    "best_mode": field("min", str, "which end of best_metric is best", choices=("min", "max")),
    "async": field(False, bool, "write in a background thread; the step only copies the arrays"),
    "sharded": field(
        True,
        bool,
        "every rank writes what it owns (replicated slice, ZeRO shard, stage, experts, "
        "tensor slices) to its own file, rank 0 commits; false, async or the parameter "
        "server: rank 0 writes one file",
    ),
    "shard_min_mb": field(
        1.0,
        (int, float),
        "replicated state is not cut into shard files smaller than this (caps the file "
        "count at scale)",
        **POSITIVE,
    ),
    "write_timeout": field(
        3600.0,
        (int, float),
        "seconds the other ranks wait for a checkpoint's write (rank 0's file, the "
        "slowest rank's shard) before the job ends as a stall naming the writer; "
        "runtime.collective_timeout does not cover it",
        **POSITIVE,
    ),
    "resume": field(
        "never", str, "auto: newest valid checkpoint in dir | never | a file (--resume)"
    ),
}


AUTO_FIRST_STEP = 20  # every_steps: auto saves here first, to measure what a save costs


def young_daly(stall_s: float, mtbf_s: float, step_s: float) -> tuple[float, int]:
    """(seconds, steps) between checkpoints that minimise the expected lost time:
    sqrt(2 C M) for a save stall C and a mean time between failures M (Young 1974, Daly
    2006: accurate while C << M)."""
    seconds = math.sqrt(2.0 * max(stall_s, 1e-6) * mtbf_s)
    return seconds, max(1, int(round(seconds / max(step_s, 1e-9))))


@dataclass(frozen=True)
class Entry:
    """One checkpoint on disk as retention sees it."""

    step: int
    path: Path
    metric: float | None = None


def section_problems(values: dict) -> list[str]:
    """The rules the fields cannot say: every_steps' only string is `auto`; a directory
    is not blank; keep_best ranks by its metric's own end."""
    problems = []
    every = values.get("every_steps")
    if isinstance(every, str) and every != "auto":
        problems.append(
            f"checkpoint.every_steps: expected a positive integer, auto or null, got {every!r}"
        )
    where = values.get("dir")
    if isinstance(where, str) and not where.strip():
        problems.append(f"checkpoint.dir: {where!r} is blank: name a directory, or null")
    resume = values.get("resume")
    if isinstance(resume, str) and not resume.strip():  # was "`.`: cannot read"
        problems.append(f"checkpoint.resume: {resume!r} is blank: auto, never or a file")
    metric = values.get("best_metric", SCHEMA["best_metric"].default)
    mode = values.get("best_mode", SCHEMA["best_mode"].default)
    if values.get("keep_best") and BEST_MODES.get(metric, mode) != mode:
        problems.append(
            f"checkpoint.best_mode={mode} would keep the {'lowest' if mode == 'min' else 'highest'}"
            f" {metric}, the worst checkpoints: set checkpoint.best_mode={BEST_MODES[metric]}"
        )
    return problems


def _validate(values: dict) -> list[str]:
    """Problems of a `checkpoint:` section given directly (the config checks its own
    with the same fields)."""
    problems = [
        f"checkpoint.{key}: unknown key (known: {', '.join(sorted(SCHEMA))})"
        for key in values
        if key not in SCHEMA
    ]
    for key, value in values.items():
        if key in SCHEMA and (problem := check_value(f"checkpoint.{key}", SCHEMA[key], value)):
            problems.append(problem)
    return problems + section_problems(values)


class CheckpointPolicy:
    """The `checkpoint:` section, validated, plus the time and step of the last save."""

    def __init__(self, section: dict | None = None, run_dir: str | Path = "."):
        values = dict(section or {})
        problems = _validate(values)
        if problems:
            raise ConfigError("invalid checkpoint configuration:\n  " + "\n  ".join(problems))
        merged = {k: values.get(k, spec.default) for k, spec in SCHEMA.items()}
        self.enabled: bool = merged["enabled"]
        self.run_dir = Path(run_dir)  # where checkpoints set aside go: <run-dir>/previous/
        self.dir = Path(merged["dir"]) if merged["dir"] else self.run_dir / "checkpoints"
        # every_steps: auto starts with one save at AUTO_FIRST_STEP to measure its cost,
        # then `young_daly` sets the interval after every save.
        self.auto = merged["every_steps"] == "auto"
        self.every_steps: int | None = None if self.auto else merged["every_steps"]
        self.mtbf_s: float = float(merged["mtbf_hours"]) * 3600.0
        self.every_minutes: float | None = merged["every_minutes"]
        self.at_epoch_end: bool = merged["at_epoch_end"]
        self.keep_last: int | None = merged["keep_last"]
        self.keep_best: int = merged["keep_best"]
        self.best_metric: str = merged["best_metric"]
        self.best_mode: str = merged["best_mode"]
        self.async_save: bool = merged["async"]
        self.sharded: bool = merged["sharded"] and not self.async_save
        self.shard_min_bytes = max(1, int(float(merged["shard_min_mb"]) * (1 << 20)))
        self.write_timeout: float = float(merged["write_timeout"])
        self.resume: str = merged["resume"]
        self.last_step: int | None = None
        self.last_time = time.monotonic()

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path) -> CheckpointPolicy:
        """From a Config (or a plain dict) holding a `checkpoint` section."""
        try:
            section = cfg["checkpoint"]
        except (KeyError, TypeError):
            section = {}
        return cls(section, run_dir)

    def due(
        self, step: int, epoch_end: bool = False, final: bool = False, now: float | None = None
    ) -> bool:
        """Should a checkpoint of `step` be written now? Never twice for the same step.

        Under MPI the time rule can differ between ranks: agree on the answer (e.g.
        `world.any_flag(policy.due(...))`) before anyone gathers state.
        """
        if not self.enabled or step == self.last_step:
            return False
        if final or (epoch_end and self.at_epoch_end):
            return True
        if self.auto:
            if self.every_steps is None:  # not measured yet: the first save measures it
                if step >= AUTO_FIRST_STEP:
                    return True
            elif step - (self.last_step or 0) >= self.every_steps:
                return True
        elif self.every_steps and step % self.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes and now - self.last_time >= self.every_minutes * 60)

    def mark_saved(self, step: int, now: float | None = None) -> None:
        self.last_step = step
        self.last_time = time.monotonic() if now is None else now

    def to_delete(self, entries: list[Entry]) -> list[Path]:
        """Paths outside the newest `keep_last` and the best `keep_best` by the metric.

        Entries without the metric (or with NaN) never count as best.
        """
        if self.keep_last is None:
            return []
        by_step = sorted(entries, key=lambda e: e.step)
        keep = {e.path for e in by_step[-self.keep_last :]}
        if self.keep_best:
            scored = [e for e in entries if e.metric is not None and not math.isnan(e.metric)]
            sign = 1.0 if self.best_mode == "min" else -1.0
            scored.sort(key=lambda e: (sign * e.metric, -e.step))
            keep.update(e.path for e in scored[: self.keep_best])
        return [e.path for e in by_step if e.path not in keep]
