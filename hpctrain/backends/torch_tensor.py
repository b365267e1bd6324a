"""Tensor parallelism in torch: Megatron's `f` and `g` as autograd functions over the
grid's tensor axis (layout and collectives: hpctrain/tensor/parallel.py).

`f` (before a column-parallel layer): identity forward, allreduce of the input's
gradient backward. `g` (after a row-parallel layer): allreduce of the partial products
forward, identity backward. Activations are summed in float32 (bf16 runs cast there
and back): on the device over the group's transport (the process-group engines: Gloo on
CPU ranks, NCCL on GPU ranks), else as numpy buffers over MPI.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..tensor.parallel import TensorGroup, split_kind
from .base import split_square_sums
from .torch_arrays import clip_grads_


def _allreduce(x: torch.Tensor, group: TensorGroup, what: str) -> torch.Tensor:
    if is_fake(x):  # the memory plan's forward (backends/torch_plan.py): shapes only
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
    lives on one of its ranks), replicated ones counted once. The norm stays where the
    gradients are (the tensor axis's and the expert group's sums over their transports),
    so a GPU rank's host never waits for it (torch_arrays.clip_grads_)."""
    names = [name for name, _ in named_params]
    device = named_params[0][1].device
    zero = torch.zeros((), dtype=torch.float64, device=device)

    def squares():
        return [
            zero if p.grad is None else p.grad.detach().double().pow(2).sum()
            for _, p in named_params
        ]

    # experts in `whole`
    split, whole = split_square_sums(names, squares, split_kind, experts=groups.experts)
    split = (zero + split).reshape(1)  # a tensor where the gradients are (no host copy)
    if groups.tensor.transport is None:  # the MPI engine: the host's numpy over the axis
        host = groups.tensor.sum_squares(split.cpu().numpy(), "gradient norm")
        split = torch.from_numpy(host).to(device)
    else:
        split = groups.tensor.sum_squares(split, "gradient norm")
    clip_grads_([p.grad for _, p in named_params if p.grad is not None], whole + split[0], max_norm)
