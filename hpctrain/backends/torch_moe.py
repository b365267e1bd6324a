"""The torch half of the MoE layer: gate, gather/scatter and autograd through the all-to-all.

Routing decisions and the MPI exchanges are framework-neutral
(hpctrain/moe); here they become differentiable: `_AllToAll` is an
autograd.Function whose backward is the reverse Alltoallv, so gradients reach both the
tokens on their home rank and the experts on their owner rank. Expert parameters are
local to a rank: they are kept out of Horovod (a separate optimizer param group, see
`add_expert_params`) and their gradient, a sum over every rank's tokens, is divided by
the number of ranks so it matches the data-parallel average of the dense parameters.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ..moe.parallel import MoELayer, is_expert_param, require_group, step_metrics
from ..runtime.comm import under_deadline
from .torch_arrays import clip_grads_
from .torch_device import to_device

_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Module -> MoELayer
_aux: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Module -> last aux loss


class _AllToAll(torch.autograd.Function):
    """Alltoallv of rows; the gradient goes back along the same rows in reverse."""

    @staticmethod
    def forward(ctx, x, moe, send_rows, recv_rows, record):
        ctx.moe, ctx.rows, ctx.record = moe, (send_rows, recv_rows), record
        return _exchange(moe, x.detach(), send_rows, recv_rows, record)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.rows
        back = _exchange(ctx.moe, grad, recv_rows, send_rows, ctx.record)
        return back, None, None, None, None


def _exchange(moe, x: torch.Tensor, send_rows, recv_rows, record) -> torch.Tensor:
    """The rows as tensors over the expert group's process group (`gloo`, `nccl`), or as
    numpy over MPI."""
    x = x.contiguous()
    if moe.group.transport is not None:
        return moe.exchange(x, send_rows, recv_rows, record)
    return torch.from_numpy(moe.exchange(x.numpy(), send_rows, recv_rows, record))


def _runtime(layer) -> MoELayer:
    if layer not in _layers:
        _layers[layer] = MoELayer(layer.spec.attrs["moe"], layer.groups.experts, layer.spec.name)
    return _layers[layer]


def moe_ffn(layer, h: torch.Tensor, router: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE feed-forward of a transformer block: h [n, t, d] -> [n, t, d]. `router`:
    the router weight as the caller passes it on (tensor parallelism: through `f`)."""
    moe = _runtime(layer)
    opts, p = moe.opts, layer.p
    router = p["moe.router.weight"] if router is None else router
    record = layer.training  # only training calls count in the step's metrics
    shape, d = h.shape, h.shape[-1]
    x = h.reshape(-1, d)

    def on(array):  # the plan's host arrays where the tokens are (no host wait on GPUs)
        return to_device(array, x.device)

    xr = x
    if layer.training and opts["jitter"] > 0:
        xr = x * on(moe.jitter_noise(x.shape))
    probs = torch.softmax(F.linear(xr, router), dim=-1)
    # The router plans on the host (hpctrain/moe): on a GPU rank a copy and a wait per
    # MoE layer and step, the one host synchronisation such a step has; behind the step's
    # queued collectives, so under the expert group's deadline (a stalled peer named).
    with under_deadline(moe.group.axis, "MoE router's read") if x.is_cuda else nullcontext():
        host_probs = probs.detach().cpu().numpy()
    plan = moe.plan(host_probs, record)
    top = probs.gather(1, on(plan.experts))
    gates = top if moe.k == 1 else top / top.sum(dim=-1, keepdim=True)
    token = on(plan.send_token)
    recv = _AllToAll.apply(x[token], moe, plan.send_rows, plan.recv_rows, record)
    t0 = time.perf_counter()
    grouped = recv[on(plan.perm)]
    outs = []
    for j, rows in enumerate(grouped.split(plan.expert_rows.tolist())):
        e = f"moe.experts.{moe.first + j}"
        hidden = F.relu(F.linear(rows, p[f"{e}.fc1.weight"], p[f"{e}.fc1.bias"]))
        outs.append(F.linear(hidden, p[f"{e}.fc2.weight"], p[f"{e}.fc2.bias"]))
    out = torch.cat(outs)[on(plan.inv_perm)] if outs else grouped
    if record:
        moe.stats.expert_s += time.perf_counter() - t0
    back = _AllToAll.apply(out, moe, plan.recv_rows, plan.send_rows, record)
    coef = gates[token, on(plan.send_slot)]
    y = torch.zeros_like(x).index_add(0, token, back * coef[:, None])
    frac = on(plan.fractions)
    _aux[layer] = opts["aux_loss"] * moe.E * (frac * probs.mean(dim=0)).sum()
    return y.reshape(shape)


def _moe_modules(model) -> list:
    return [m for m in model.modules() if "moe" in getattr(getattr(m, "spec", None), "attrs", {})]


def aux_loss(model) -> torch.Tensor | None:
    """Sum of the load-balancing losses of the model's last forward (None without MoE),
    per batch: with tensor parallelism each of a batch's T ranks routed 1/T of it."""
    modules = [m for m in _moe_modules(model) if m in _aux]
    if not modules:
        return None
    ranks_per_batch = require_group(modules[0].groups.experts).ranks_per_batch
    return torch.stack([_aux[m] for m in modules]).sum() / ranks_per_batch


def dense_named_parameters(model) -> list:
    """(name, parameter) pairs Horovod averages: everything but the experts."""
    return [(n, p) for n, p in model.named_parameters() if not is_expert_param(n)]


def add_expert_params(optimizer, model, group) -> None:
    """Give the local experts to the optimizer as their own group, outside Horovod.

    Horovod's DistributedOptimizer allreduces exactly the parameters it was built with;
    a group added afterwards is stepped by the same torch optimizer (same lr, same
    state layout for checkpoints) but never allreduced or broadcast. Each expert
    gradient sums every batch's tokens, so it is divided by the number of batches (the
    group's ranks, or with tensor parallelism its tensor groups).
    """
    experts = scale_expert_grads(model, group)
    if experts:
        optimizer.add_param_group({"params": experts})


def scale_expert_grads(model, group) -> list:
    """Hooks scaling each local expert's gradient to the mean over the batches its
    group (`group`, the expert group) holds; returns the expert parameters."""
    experts = [p for n, p in model.named_parameters() if is_expert_param(n)]
    scale = require_group(group).grad_scale if experts else 1.0
    for p in experts:
        p.register_hook(lambda g: g * scale)
    return experts


@torch.no_grad()
def average_expert_grads(model, group) -> None:
    """Average the local experts' gradients over their data-parallel replicas (one
    flat allreduce on the grid's `data` axis: MPI, or its process group on `gloo` and
    `nccl`; nothing when there is one replica)."""
    if group is None or group.data is None or group.data.size == 1:
        return
    grads = [
        p.grad for n, p in model.named_parameters() if is_expert_param(n) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.average_over_replicas(flat if group.data_transport is not None else flat.numpy())
    for g, view in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(view.view_as(g))


def clip_grad_norm_(model, max_norm: float, group) -> None:
    """torch's clip_grad_norm_ over the global model: expert norms summed over ranks."""
    named = list(model.named_parameters())
    if not any(is_expert_param(n) for n, _ in named):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    zero = torch.zeros((), dtype=torch.float64, device=named[0][1].device)
    sq = {True: zero, False: zero}  # summed where the gradients are
    for n, p in named:
        if p.grad is not None:
            sq[is_expert_param(n)] = sq[is_expert_param(n)] + p.grad.detach().double().pow(2).sum()
    experts = require_group(group).allreduce_sum(sq[True])  # on the device over a transport
    clip_grads_([p.grad for _, p in named if p.grad is not None], sq[False] + experts, max_norm)


def step_extra(model, step_seconds: float) -> dict:
    """This step's MoE metrics (empty without MoE); resets the counters."""
    layers = [_layers[m] for m in _moe_modules(model) if m in _layers]
    return step_metrics(layers, step_seconds, layers[0].group.size) if layers else {}
