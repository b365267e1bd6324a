"""How a restart with another number of replicas keeps the optimisation the same.

The global batch stays fixed when it can (`train.grad_accum` absorbs the lost replicas,
and `optimizer.lr` is set so that the scaled learning rate is the one of the first
launch); otherwise the per-rank batch stays, the global batch changes and the
configured `optimizer.lr_scaling` rule sets the learning rate. Either way it is said.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..lr_schedule import scaled_lr
from ..shape import JobShape


@dataclass(frozen=True)
class BatchPlan:
    replicas: int
    grad_accum: int
    lr: float  # optimizer.lr to pass (before scaling by the replicas)
    global_batch: int
    note: str
    microbatches: int | None = None  # pipeline.microbatches to pass (the pipeline only)


def replicas_of(cfg, world_size: int) -> int:
    """Data-parallel replicas of a world: what the learning rate and the batch scale with
    (a pipeline's replica is stages x tensor ranks: JobShape)."""
    return JobShape.of(cfg, world_size).replicas


def ranks_per_replica(cfg) -> int:
    return JobShape.of(cfg, 0).ranks_per_replica


def plan_batch(cfg, first_replicas: int, replicas: int) -> BatchPlan:
    """The settings for `replicas` that match a first launch on `first_replicas`.

    The pipeline accumulates over its micro-batches (each of `train.batch_size`), so
    there `pipeline.microbatches` absorbs the lost replicas instead of `grad_accum`.
    """
    o, b = cfg.optimizer, cfg.train["batch_size"]
    pipeline = cfg["strategy"] == "pipeline"
    accum = cfg.pipeline["microbatches"] if pipeline else cfg.train["grad_accum"]
    knob = "pipeline.microbatches" if pipeline else "train.grad_accum"
    base, rule = float(o["lr"]), o["lr_scaling"]
    target = b * accum * first_replicas
    peak = scaled_lr(base, rule, first_replicas)

    def plan(replicas, accum, lr, global_batch, note):
        if pipeline:
            return BatchPlan(replicas, 1, lr, global_batch, note, microbatches=accum)
        return BatchPlan(replicas, accum, lr, global_batch, note)

    if replicas == first_replicas:
        return plan(replicas, accum, base, target, "as launched")
    if target % (b * replicas) == 0:
        new_accum = target // (b * replicas)
        lr = peak / scaled_lr(1.0, rule, replicas)
        return plan(
            replicas,
            new_accum,
            lr,
            target,
            f"global batch kept at {target}: {knob} {accum} -> {new_accum}, "
            f"optimizer.lr {base:g} -> {lr:g} (scaled lr stays {peak:g})",
        )
    changed = b * accum * replicas
    lr_now = scaled_lr(base, rule, replicas)
    return plan(
        replicas,
        accum,
        base,
        changed,
        f"global batch {target} -> {changed} ({target} is not a multiple of batch_size "
        f"{b} x {replicas} replicas); optimizer.lr_scaling={rule} gives "
        f"lr {lr_now:g} instead of {peak:g}"
        + ("" if rule != "none" or math.isclose(lr_now, peak) else " (no scaling)"),
    )
