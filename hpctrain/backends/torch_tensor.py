"""Tensor parallelism in torch: Megatron's `f` and `g` as autograd functions over the
grid's tensor axis (layout and collectives: hpctrain/tensor/parallel.py).

`f` (before a column-parallel layer): identity forward, allreduce of the input's
gradient backward. `g` (after a row-parallel layer): allreduce of the partial products
forward, identity backward. Activations travel as float32 numpy buffers (bf16 runs cast
there and back).
"""

from __future__ import annotations

import numpy as np
import torch

from ..tensor.parallel import split_kind, tensor_group
from .base import split_square_sums


def _allreduce(x: torch.Tensor, what: str) -> torch.Tensor:
    summed = tensor_group().allreduce_sum(x.detach().float().contiguous().numpy(), what)
    return torch.from_numpy(summed).to(x.dtype)


class _CopyToTensorAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad, "input gradient (f)")


class _ReduceFromTensorAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _allreduce(x, "partial output (g)")

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tensor_axis(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTensorAxis.apply(x)


def reduce_from_tensor_axis(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTensorAxis.apply(x)


@torch.no_grad()
def clip_grad_norm_(named_params, max_norm: float) -> None:
    """torch's clip_grad_norm_ rule on the whole model: the squares of split parameters
    are summed over the tensor axis, those of experts over their group (each expert
    lives on one of its ranks), replicated ones counted once."""
    names = [name for name, _ in named_params]

    def squares():
        return [
            0.0 if p.grad is None else float(p.grad.detach().double().pow(2).sum())
            for _, p in named_params
        ]

    split, whole = split_square_sums(names, squares, split_kind)  # experts in `whole`
    split = float(tensor_group().allreduce_sum(np.array([split]), "gradient norm")[0])
    coef = max_norm / ((whole + split) ** 0.5 + 1e-6)
    if coef < 1.0:
        for _, p in named_params:
            if p.grad is not None:
                p.grad.mul_(coef)
