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

# key: (default, doc); the config schema mirrors this table.
DEFAULTS: dict[str, tuple] = {
    "enabled": (True, "write checkpoints at all"),
    "dir": (None, "checkpoint directory (default <run-dir>/checkpoints)"),
    "every_steps": (None, "save every N optimizer steps (null: off; auto: Young/Daly)"),
    "mtbf_hours": (24.0, "mean time between failures of the job (every_steps: auto)"),
    "every_minutes": (30.0, "save when this many minutes passed since the last save (null: off)"),
    "at_epoch_end": (True, "save at the end of every epoch"),
    "keep_last": (3, "keep the newest N checkpoints (null: keep all)"),
    "keep_best": (0, "also keep the best N by best_metric"),
    "best_metric": ("val_loss", "metric that ranks checkpoints for keep_best"),
    "best_mode": ("min", "min or max: which end of best_metric is best"),
    "async": (False, "write in a background thread (the caller only copies the arrays)"),
    "sharded": (True, "every rank writes its part to its own file; rank 0 commits (sharded.py)"),
    "shard_min_mb": (1.0, "replicated state is not cut into shard files smaller than this"),
    "write_timeout": (3600.0, "seconds the other ranks wait for a checkpoint write"),
    "resume": ("never", "auto: continue from the newest valid checkpoint in dir; never; or a file"),
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


def _problem(key, value, want) -> str:
    return f"checkpoint.{key}: expected {want}, got {value!r}"


def _validate(values: dict) -> list[str]:
    problems = []
    for key in values:
        if key not in DEFAULTS:
            problems.append(f"checkpoint.{key}: unknown key (known: {', '.join(sorted(DEFAULTS))})")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_positive_number(x):
        return (
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
        )

    v = values
    for key in ("enabled", "at_epoch_end", "async", "sharded"):
        if key in v and not isinstance(v[key], bool):
            problems.append(_problem(key, v[key], "true or false"))
    es = v.get("every_steps")
    if es is not None and es != "auto" and not (is_int(es) and es > 0):
        problems.append(_problem("every_steps", es, "a positive integer, auto or null"))
    for key, what in (
        ("mtbf_hours", "a positive number"),
        ("write_timeout", "a positive number of seconds"),
        ("shard_min_mb", "a positive number"),
    ):
        if key in v and not is_positive_number(v[key]):
            problems.append(_problem(key, v[key], what))
    em = v.get("every_minutes")
    if em is not None and not (
        isinstance(em, (int, float)) and not isinstance(em, bool) and math.isfinite(em) and em > 0
    ):
        problems.append(_problem("every_minutes", em, "a positive number or null"))
    if v.get("keep_last") is not None and not (is_int(v["keep_last"]) and v["keep_last"] > 0):
        problems.append(_problem("keep_last", v["keep_last"], "a positive integer or null"))
    if "keep_best" in v and not (is_int(v["keep_best"]) and v["keep_best"] >= 0):
        problems.append(_problem("keep_best", v["keep_best"], "an integer >= 0"))
    if "best_mode" in v and v["best_mode"] not in ("min", "max"):
        problems.append(_problem("best_mode", v["best_mode"], "min or max"))
    for key in ("best_metric", "resume"):
        if key in v and not (isinstance(v[key], str) and v[key]):
            problems.append(_problem(key, v[key], "a non-empty string"))
    if v.get("dir") is not None and not isinstance(v["dir"], str):
        problems.append(_problem("dir", v["dir"], "a path or null"))
    return problems


class CheckpointPolicy:
    """The `checkpoint:` section, validated, plus the time and step of the last save."""

    def __init__(self, section: dict | None = None, run_dir: str | Path = "."):
        values = dict(section or {})
        problems = _validate(values)
        if problems:
            raise ConfigError("invalid checkpoint configuration:\n  " + "\n  ".join(problems))
        merged = {k: values.get(k, default) for k, (default, _) in DEFAULTS.items()}
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
