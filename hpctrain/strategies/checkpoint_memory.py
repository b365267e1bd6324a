"""Host memory the rank that writes a gathered checkpoint holds beside its training
memory, for the limit check before any compute (memory_check.py).

A sharded checkpoint (the default with more than one rank) has every rank write its own
part: nothing is gathered. Otherwise (`checkpoint.async`, `checkpoint.sharded: false`,
one rank) rank 0 writes one file of the whole model's state, and may hold a copy of it:
a rank whose state must be gathered or copied off a GPU first, or an async save's own
copy, which stays in reused buffers between saves (checkpoint/staging.py). Without this
term a model sized to fit its ranks is killed on rank 0 at its first save, mid-run.

Measured (rank 0 of a 50 M transformer, Adam, np 2, 578 MiB of state; peak RSS over
the steps against the same run without checkpoints): ZeRO-3 async +553 MiB, ZeRO-3
gathered +501, plain gathered (views, no copy) +21, plain async +300 (the copy reuses
heap a step freed, so one planned copy is above that peak, by up to 12% of the run's
peak), sharded +12 (tests/test_memory_plan_jobs.py); tensor parallelism 2 gathered
+297 and async +463, a 2-stage pipeline's rank 0 gathered +424 and async +566 (1.5-3.7
copies while these gathers pickled the state).
"""

from __future__ import annotations

import numpy as np

from ..backends.base import OPTIMIZER_SLOTS
from ..exchange.compression import LOSSY
from ..models import zoo


def checkpoint_copies(
    checkpoint: dict, rank: int, size: int, gpu: bool, gathers: bool, written_at_once=False
) -> int:
    """Whole copies of the model's state `rank` holds in host memory at a save.

    `gathers`: the strategy exports fresh arrays (ZeRO; tensor parallelism, spread
    experts and pipeline stages received into arrays rank 0 owns, comm.gather_arrays;
    TensorFlow's copies); otherwise a CPU rank exports views of its live tensors and a
    GPU rank host copies (staged by an async save into pinned buffers, which it copies
    again for the writer: two; each pinned buffer is rounded up to a power of two by
    torch, not counted). `written_at_once`: per-rank state (has_rank_state) makes an async
    save synchronous (checkpoint/manager.py), with neither staging nor a private copy."""
    if rank != 0 or not checkpoint["enabled"]:
        return 0
    if checkpoint["sharded"] and not checkpoint["async"] and size > 1:
        return 0
    if gathers:
        return 1
    background = checkpoint["async"] and not written_at_once
    if gpu:
        return 2 if background else 1
    return 1 if background else 0


def has_rank_state(cfg, size: int) -> bool:
    """Whether every rank keeps state of its own that a checkpoint saves per rank
    (strategies' rank_state): error-feedback residuals or PowerSGD's factors, or local
    SGD's optimizer state on more than one rank."""
    method = cfg.train["compression"]
    lossy = method in LOSSY and (cfg.compression["error_feedback"] or method == "powersgd")
    return lossy or (cfg.train["sync_every"] > 1 and size > 1)


def model_state_bytes(cfg, inp: zoo.InputSpec) -> float | None:
    """Bytes of a zoo model's whole float32 state as a checkpoint holds it: every
    parameter (all experts, whole tensor-parallel layers, every pipeline stage), its
    optimizer's slots (every slot of its kind: plain SGD's momentum buffers are saved as
    zeros) and the buffers. None for a user's model (not known before it is built)."""
    if not zoo.is_zoo_model(cfg.model["name"]):
        return None
    layers = zoo.build_layers(cfg.model, inp)
    params = sum(spec.param_count() for spec in layers)
    buffers = sum(int(np.prod(s)) for spec in layers for s in spec.buffers.values())
    return 4.0 * ((1 + len(OPTIMIZER_SLOTS[cfg.optimizer["name"]])) * params + buffers)


def checkpoint_host_bytes(cfg, inp, rank: int, size: int, gpu: bool, gathers: bool) -> float:
    """checkpoint_copies x model_state_bytes (0 for a user's model). Local: no
    communication, the same cost at 1,024 and 4,096 ranks."""
    at_once = has_rank_state(cfg, size)
    copies = checkpoint_copies(cfg.checkpoint, rank, size, gpu, gathers, at_once)
    state = model_state_bytes(cfg, inp) if copies else None
    return copies * state if state else 0.0


def checkpoint_hint(checkpoint: dict, size: int) -> str:
    """What frees rank 0 of the gathered copy."""
    if size == 1:
        return "checkpoint.enabled=false (one rank writes its whole state)"
    settings = [
        *(["checkpoint.async=false"] if checkpoint["async"] else []),
        *(["checkpoint.sharded=true"] if not checkpoint["sharded"] else []),
    ]
    return f"{' and '.join(settings)} (every rank then writes its own part: nothing gathered)"
