"""Learning rate as a pure function of the step, so a resumed run gets the same values.

Scaling with the number of ranks follows Goyal et al. (2017): linear (lr x N) or sqrt
(lr x sqrt N). Warm-up ramps linearly from the base lr to the scaled lr over
`warmup_epochs`, then the lr stays constant or follows a cosine to zero.
"""

from __future__ import annotations

import math


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
