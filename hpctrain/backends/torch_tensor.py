"""Tensor parallelism in torch: Megatron's `f` and `g` as autograd functions over the
grid's tensor axis (layout and collectives: hpctrain/tensor/parallel.py).

`f` (before a column-parallel layer): identity forward, allreduce of the input's
gradient backward. `g` (after a row-parallel layer): allreduce of the partial products
forward, identity backward. Activations are summed in float32 (bf16 runs cast there
and back): on the device over the group's transport (the process-group engines: Gloo on
CPU ranks, NCCL on GPU ranks), else as numpy buffers over MPI.
"""

from __future__ import annotations

import numpy as np
import torch

from ..tensor.parallel import TensorGroup, split_kind
from .base import split_square_sums


def _allreduce(x: torch.Tensor, group: TensorGroup, what: str) -> torch.Tensor:
    if x.is_meta:  # the memory plan's forward on the meta device: shapes only
        return torch.empty_like(x)
    if group.transport is not None:  # on the device: no copy to the host
        buf = x.detach().to(torch.float32, copy=True).contiguous()
        group.transport.allreduce_inplace(buf, "sum", f"tensor-parallel {what}")
        return buf.to(x.dtype)
    summed = group.allreduce_sum(x.detach().float().contiguous().numpy(), what)
    return torch.from_numpy(summed).to(x.dtype)


class _CopyToTensorAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad, ctx.group, "input gradient (f)"), None


class _ReduceFromTensorAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _allreduce(x, group, "partial output (g)")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_axis(x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    return _CopyToTensorAxis.apply(x, group)


def reduce_from_tensor_axis(x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    return _ReduceFromTensorAxis.apply(x, group)


@torch.no_grad()
def clip_grad_norm_(named_params, max_norm: float, groups) -> None:
    """torch's clip_grad_norm_ rule on the whole model: the squares of split parameters
    are summed over the tensor axis, those of experts over their group (each expert
    lives on one of its ranks), replicated ones counted once."""
    names = [name for name, _ in named_params]

    def squares():
        return [
            0.0 if p.grad is None else float(p.grad.detach().double().pow(2).sum())
            for _, p in named_params
        ]

    # experts in `whole`
    split, whole = split_square_sums(names, squares, split_kind, experts=groups.experts)
    split = float(groups.tensor.allreduce_sum(np.array([split]), "gradient norm")[0])
    coef = max_norm / ((whole + split) ** 0.5 + 1e-6)
    if coef < 1.0:
        for _, p in named_params:
            if p.grad is not None:
                p.grad.mul_(coef)
