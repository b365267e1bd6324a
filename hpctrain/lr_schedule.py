"""Learning rate as a pure function of the step, so a resumed run gets the same values.

Scaling with the number of ranks follows Goyal et al. (2017): linear (lr x N) or sqrt
(lr x sqrt N). Warm-up ramps linearly from the base lr to the scaled lr over
`warmup_epochs`, then the lr stays constant or follows a cosine to zero.

A cosine's lr depends on the schedule's length: a run resumed with another
train.epochs/max_steps follows `resumed_schedule` (optimizer.resume_schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def scaled_lr(base: float, scaling: str, world_size: int) -> float:
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[scaling]
    return base * factor


def lr_at(step: int, ocfg: dict, world_size: int, steps_per_epoch: int, total_steps: int) -> float:
    base = float(ocfg["lr"])
    peak = scaled_lr(base, ocfg["lr_scaling"], world_size)
    warmup = int(round(ocfg["warmup_epochs"] * steps_per_epoch))
    if step < warmup:
        return base + (peak - base) * step / warmup
    if ocfg["schedule"] == "cosine":
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak


RESUME_MODES = ("stretch", "continue")


@dataclass(frozen=True)
class Schedule:
    """The lr of every step of one run: `lr_at` over `length` steps.

    `hold`: past this step the lr stays at that step's value (`optimizer.resume_schedule:
    continue`, a saved schedule followed past its end at its final lr).
    """

    ocfg: dict
    steps_per_epoch: int
    length: int
    hold: int | None = None

    def lr(self, step: int, replicas: int) -> float:
        if self.hold is not None and step > self.hold:
            step = self.hold
        return lr_at(step, self.ocfg, replicas, self.steps_per_epoch, self.length)


@dataclass(frozen=True)
class ResumedSchedule:
    """What a resumed run follows, and the line that says so (None: nothing changed)."""

    schedule: Schedule
    message: str | None = None
    warn: bool = False


def resumed_schedule(
    ocfg: dict,
    replicas: int,
    steps_per_epoch: int,
    total_steps: int,
    step: int,
    saved_length: int | None,
) -> ResumedSchedule:
    """The schedule of a run resumed at `step` from a checkpoint whose schedule spanned
    `saved_length` steps (None: unknown, an older checkpoint), now `total_steps` long.

    A cosine's lr depends on its length, so a resume with another train.epochs or
    train.max_steps changes the lr from the resume step on. `ocfg["resume_schedule"]`:
    stretch (the default) spreads the cosine over the new length (the lr jumps to where
    the longer cosine is at that step); continue keeps the saved schedule and, past its
    end, its final lr (that of its last step). Either way the jump is said.
    """
    mode = ocfg.get("resume_schedule", "stretch")
    if mode not in RESUME_MODES:
        raise ValueError(f"optimizer.resume_schedule: {mode!r} is not one of {RESUME_MODES}")
    stretched = Schedule(ocfg, steps_per_epoch, total_steps)
    if not saved_length or saved_length == total_steps or ocfg["schedule"] != "cosine":
        return ResumedSchedule(stretched)  # the same lr at every step either way
    saved = Schedule(ocfg, steps_per_epoch, saved_length, hold=saved_length - 1)
    old, new = saved.lr(step, replicas), stretched.lr(step, replicas)
    change = (
        f"the cosine now spans {total_steps} steps (train.epochs/train.max_steps), the "
        f"checkpoint's spanned {saved_length}"
    )
    final = saved.lr(saved.hold, replicas)  # the lr of the saved schedule's last step
    if mode == "stretch":
        if math.isclose(old, new, rel_tol=1e-3, abs_tol=1e-12):
            return ResumedSchedule(stretched)
        keep = f" and its final lr {final:.3g}" if saved_length < total_steps else ""
        return ResumedSchedule(
            stretched,
            f"lr schedule on resume: {change}, so at step {step} the lr goes from {old:.3g} "
            f"(the saved schedule) to {new:.3g} (optimizer.resume_schedule: stretch); "
            f"optimizer.resume_schedule=continue keeps the saved schedule{keep}",
            warn=True,
        )
    tail = ""
    if saved_length < total_steps:
        tail = (
            f"; from step {max(step, saved.hold)} to {total_steps} the lr stays at its "
            f"final {final:.3g}"
        )
    return ResumedSchedule(
        saved,
        f"lr schedule on resume (optimizer.resume_schedule: continue): {change}; the saved "
        f"schedule continues at lr {old:.3g} (stretch would give {new:.3g}){tail}",
    )
