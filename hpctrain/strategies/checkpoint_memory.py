"""Host memory the rank that writes a gathered checkpoint holds beside its training
memory, for the limit check before any compute (memory_check.py).

A sharded checkpoint (the default with more than one rank) has every rank write its own
part: nothing is gathered. Otherwise (`checkpoint.async`, `checkpoint.sharded: false`,
one rank) rank 0 writes one file of the whole model's state, and may hold a copy of it:
a rank whose state must be gathered or copied off a GPU first, or an async save's own
copy, which stays in reused buffers between saves (checkpoint/staging.py). Without this
term a model sized to fit its ranks is killed on rank 0 at its first save, mid-run.

Measured (rank 0 of a 50 M transformer, Adam, np 2, 577 MiB of state; peak RSS over
the steps against the same run without checkpoints): ZeRO-3 async +553 MiB, ZeRO-3
gathered +501, plain gathered (views, no copy) +21, plain async +300 (the copy reuses
heap a step freed, so one planned copy is above that peak by 15% of the run's peak),
sharded +12 (tests/test_memory_plan_jobs.py).
"""

from __future__ import annotations

import numpy as np

from ..exchange.memory_plan import optimizer_slots
from ..models import zoo


def checkpoint_copies(checkpoint: dict, rank: int, size: int, gpu: bool, gathers: bool) -> int:
    """Whole copies of the model's state `rank` holds in host memory at a save.

    `gathers`: the strategy exports fresh arrays (ZeRO, tensor parallelism, spread
    experts, pipeline stages, the parameter server); otherwise a CPU rank exports views
    of its live tensors and a GPU rank host copies (staged by an async save into pinned
    buffers, which it copies again for the writer: two)."""
    if rank != 0 or not checkpoint["enabled"]:
        return 0
    if checkpoint["sharded"] and not checkpoint["async"] and size > 1:
        return 0
    if gathers:
        return 1
    if gpu:
        return 2 if checkpoint["async"] else 1
    return 1 if checkpoint["async"] else 0


def model_state_bytes(cfg, inp: zoo.InputSpec) -> float | None:
    """Bytes of a zoo model's whole float32 state as a checkpoint holds it: every
    parameter (all experts, whole tensor-parallel layers, every pipeline stage), its
    optimizer slots and the buffers. None for a user's model (not known before it is
    built)."""
    if not zoo.is_zoo_model(cfg.model["name"]):
        return None
    layers = zoo.build_layers(cfg.model, inp)
    params = sum(spec.param_count() for spec in layers)
    buffers = sum(int(np.prod(s)) for spec in layers for s in spec.buffers.values())
    return 4.0 * ((1 + optimizer_slots(cfg.optimizer)) * params + buffers)


def checkpoint_host_bytes(cfg, inp, rank: int, size: int, gpu: bool, gathers: bool) -> float:
    """checkpoint_copies x model_state_bytes (0 for a user's model). Local: no
    communication, the same cost at 1,024 and 4,096 ranks."""
    copies = checkpoint_copies(cfg.checkpoint, rank, size, gpu, gathers)
    state = model_state_bytes(cfg, inp) if copies else None
    return copies * state if state else 0.0


def checkpoint_hint(checkpoint: dict) -> str:
    """What frees rank 0 of the gathered copy."""
    if checkpoint["async"]:
        return "checkpoint.async=false (every rank then writes its own part: nothing gathered)"
    return "checkpoint.sharded=true (every rank writes its own part: nothing gathered)"
