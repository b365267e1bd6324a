"""One training step for every backend, written once over a few framework primitives.

A data-parallel step is the same sequence in torch and TensorFlow; only the calls that
touch a framework's tensors differ. `train_step(backend, ...)` runs the sequence and a
backend provides the primitives of `StepPrimitives` (torch_primitives.py for torch,
TensorFlowBackend's methods for TF). The order of operations is the sequence's, so
both frameworks (and the one-process reference) round identically.

Replicated step:

    begin(lr) -> forward_backward(micro-batches) -> exchange (dense gradients over the
    replicas, experts over their copies; timed as communication) -> true_scale (fp16
    loss scaling) -> clip by the whole model's norm (tensor-parallel rule, or the local
    one) -> update -> step metrics (MoE, reducer, memory)

ZeRO-1/2 step:

    zero_begin(lr) -> zero_forward_backward (stage 2 reduce-scatters per micro-batch)
    -> zero_reduce (what is still pending, and the experts' average) -> clip: the shard sums plus the
    experts' squares summed over their group -> zero_update (shard, experts) -> step
    metrics (MoE, traffic, memory)

`grads` is whatever a backend's primitives pass between them: torch keeps gradients
in `param.grad` (None here), TF hands a list of tensors along.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from ..tensor.parallel import split_kind
from .base import StepStats
from .groups import ModelGroups


class StepPrimitives(Protocol):
    """What a backend provides for `train_step` (docs/architecture.md says why each)."""

    groups: ModelGroups  # the tensor axis and expert group, from the process grid
    zero: Any  # the ZeRO partition (None: replicated optimizer state)
    clip: float | None  # train.clip_norm
    exchange_step: int  # optimizer steps taken (reducers' warm-up, local SGD)

    # the replicated step
    def begin(self, lr: float) -> None: ...
    def forward_backward(self, micro_batches, tally: bool) -> tuple[Any, float, int, int]: ...
    def exchange(self, grads) -> Any: ...
    def true_scale(self) -> None: ...
    def clip_tensor_parallel(self, grads, max_norm: float) -> Any: ...
    def clip_local(self, grads, max_norm: float) -> Any: ...
    def update(self, grads, lr: float) -> None: ...
    def moe_metrics(self, step_seconds: float) -> dict: ...
    def reducer_stats(self) -> dict: ...
    def memory(self, grads=None) -> dict[str, float]: ...
    # ZeRO-1/2
    def dense_names(self) -> list[str]: ...
    def zero_begin(self, lr: float) -> None: ...
    def zero_forward_backward(
        self, micro_batches, tally: bool
    ) -> tuple[Any, float, int, int, float]: ...
    def zero_reduce(self, pending) -> Any: ...
    def expert_square_sum(self, experts) -> float | None: ...
    def scale_experts(self, experts, coef: float) -> Any: ...
    def zero_update(self, experts, lr: float) -> None: ...


def train_step(b: StepPrimitives, micro_batches, lr: float, tally: bool = True) -> StepStats:
    """One optimizer step of backend `b` over its micro-batches (see the module doc).
    `tally=False`: the step need not count correct predictions (Backend.train_step)."""
    if b.zero is not None:
        return zero_step(b, micro_batches, lr, tally)
    t_step = time.perf_counter()
    b.begin(lr)
    grads, loss_sum, correct, total = b.forward_backward(micro_batches, tally)
    t0 = time.perf_counter()
    grads = b.exchange(grads)
    comm = time.perf_counter() - t0
    b.true_scale()  # the average's true scale, before the clip sees it
    if b.clip is not None and b.groups.tensor_parallel:
        grads = b.clip_tensor_parallel(grads, float(b.clip))
    elif b.clip is not None:
        grads = b.clip_local(grads, float(b.clip))
    b.update(grads, lr)
    extra = b.moe_metrics(time.perf_counter() - t_step)
    extra.update(b.reducer_stats())
    extra.update(b.memory(grads))
    return StepStats(loss_sum, correct, total, comm, extra)


def zero_step(b: StepPrimitives, micro_batches, lr: float, tally: bool = True) -> StepStats:
    """ZeRO-1/2: reduce-scatter, clip by the global norm, update the shard, allgather."""
    z, t_step = b.zero, time.perf_counter()
    b.zero_begin(lr)
    pending, loss_sum, correct, total, comm = b.zero_forward_backward(micro_batches, tally)
    t0 = time.perf_counter()
    experts = b.zero_reduce(pending)  # the experts' gradients (averaged), or None
    if b.clip is not None:
        extra_sq = 0.0
        local = b.expert_square_sum(experts)
        if local is not None:  # each expert lives on one rank of its group
            extra_sq = b.groups.experts.allreduce_sum(local)
        coef = z.clip(float(b.clip), tensor_split_mask(b), extra_sq)  # where the shard is
        if experts:  # by 1 when under the limit (exact): no host `if` on a device's value
            experts = b.scale_experts(experts, coef)
    b.zero_update(experts, lr)
    comm += time.perf_counter() - t0  # includes the shard's update
    b.exchange_step += 1
    extra = b.moe_metrics(time.perf_counter() - t_step)  # as the replicated step's
    extra.update({"comm_bytes": float(z.part.take_sent()), "compression_ratio": 1.0})
    extra.update(b.memory())
    return StepStats(loss_sum, correct, total, comm, extra)


def tensor_split_mask(b: StepPrimitives):
    """(shard mask of the tensor-split parameters, tensor group), or None without tensor
    parallelism; the mask is computed once per backend."""
    group = b.groups.tensor
    if group.size == 1:
        return None
    mask = getattr(b, "_split_mask", None)
    if mask is None:
        split = {i for i, n in enumerate(b.dense_names()) if split_kind(n) is not None}
        part = b.zero.part  # the mask where the shard lives (a device's, on GPU ranks)
        mask = b._split_mask = part.arrays.from_host(part.shard_mask(split))
    return mask, group
