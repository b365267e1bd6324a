"""Zoo models as torch nn.Modules: the zoo's layer kinds interpreted with torch ops,
parameters under their canonical names, canonical initial weights (the same at any
world size), each rank keeping its experts and tensor-parallel pieces."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..models import zoo
from ..moe.parallel import local_layers
from ..tensor import parallel as tensor_parallel
from . import torch_moe, torch_tensor
from .base import init_stream  # noqa: F401 - importable from here
from .groups import ModelGroups


# --- the zoo's layer kinds, interpreted with torch ops ---------------------------------
class _Container(nn.Module):
    """An empty module that only groups children, so names come out canonical."""

    def forward(self, *args):  # pragma: no cover - never called
        raise RuntimeError("container")


def _child(root: nn.Module, dotted: str) -> nn.Module:
    node = root
    for part in dotted.split("."):
        if part not in node._modules:
            node.add_module(part, _Container())
        node = node._modules[part]
    return node


def _causal_attention(qkv, heads: int, fused: bool | None = None):
    """Masked self-attention of `heads` heads from the packed q, k, v projections
    [n, t, 3 * heads * dh]; returns [n, t, heads * dh]. `fused` (None: on GPU ranks)
    picks torch's fused kernel over the explicit softmax."""
    n, t, width = qkv.shape[0], qkv.shape[1], qkv.shape[-1] // 3
    dh = width // heads
    q, k, v = (z.reshape(n, t, heads, dh).transpose(1, 2) for z in qkv.split(width, -1))
    if qkv.is_cuda if fused is None else fused:  # flash / memory-efficient kernels
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return att.transpose(1, 2).reshape(n, t, width)
    scores = (q @ k.transpose(-2, -1)) / float(np.sqrt(dh))
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).reshape(n, t, width)


def _unallocated(shape, device) -> torch.Tensor:
    """A float32 tensor of `shape` on `device` without memory (storage resized to 0):
    ZeRO-3 points it into a unit's buffer before it is used. Made on the rank's device,
    so that moving the model there leaves it alone: a copy to CUDA would read the
    0-byte storage."""
    t = torch.empty(shape, device=device)  # host pages never touched; a CUDA block freed
    t.untyped_storage().resize_(0)
    return t


class _Layer(nn.Module):
    def __init__(
        self, spec: zoo.LayerSpec, groups: ModelGroups | None = None, lazy_on=None,
        fused_attention: bool | None = None,
    ):  # fmt: skip
        super().__init__()
        self.spec = spec
        self.fused_attention = fused_attention  # None: torch's fused kernel on GPU ranks
        self.groups = groups or ModelGroups()  # tensor axis and experts of this model
        self.p: dict[str, torch.Tensor] = {}
        for name, shape in spec.params.items():
            holder, leaf = self._holder(name)
            param = nn.Parameter(
                torch.zeros(shape) if lazy_on is None else _unallocated(shape, lazy_on)
            )
            holder.register_parameter(leaf, param)
            self.p[name] = param
        for name, shape in spec.buffers.items():
            holder, leaf = self._holder(name)
            holder.register_buffer(leaf, torch.zeros(shape))
            self.p[name] = getattr(holder, leaf)

    def _holder(self, name: str):
        if "." in name:
            parent, leaf = name.rsplit(".", 1)
            return _child(self, parent), leaf
        return self, name

    def _bn(self, x, prefix):
        return F.batch_norm(
            x,
            self.p[f"{prefix}.running_mean"],
            self.p[f"{prefix}.running_var"],
            self.p[f"{prefix}.weight"],
            self.p[f"{prefix}.bias"],
            training=self.training,
            momentum=zoo.BN_MOMENTUM,
            eps=zoo.BN_EPS,
        )

    def forward(self, x):
        kind, p, a = self.spec.kind, self.p, self.spec.attrs
        if kind == "flatten":
            return x.reshape(x.shape[0], -1)
        if kind == "dense":
            y = F.linear(x, p["weight"], p["bias"])
            return F.relu(y) if a["relu"] else y
        if kind == "conv":
            y = F.conv2d(x, p["weight"], p.get("bias"), stride=a["stride"], padding=a["padding"])
            return F.relu(y) if a["relu"] else y
        if kind == "gap":
            return x.mean(dim=(2, 3))
        if kind == "conv_bn":
            return F.relu(self._bn(F.conv2d(x, p["conv.weight"], None, a["stride"], 1), "bn"))
        if kind == "resblock":
            s = a["stride"]
            out = F.relu(self._bn(F.conv2d(x, p["conv1.weight"], None, s, 1), "bn1"))
            out = self._bn(F.conv2d(out, p["conv2.weight"], None, 1, 1), "bn2")
            if "shortcut.conv.weight" in p:
                x = self._bn(F.conv2d(x, p["shortcut.conv.weight"], None, s, 0), "shortcut.bn")
            return F.relu(out + x)
        if kind == "embed":
            return p["tok.weight"][x] + p["pos.weight"][: x.shape[1]]
        if kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"], zoo.LN_EPS)
        if kind == "block":
            return self._block(x)
        raise ValueError(f"unknown layer kind {kind!r}")

    def _block(self, x):
        if self.spec.attrs.get("tensor", 1) > 1:
            return self._tensor_parallel_block(x)
        p, heads = self.p, self.spec.attrs["n_heads"]
        d = x.shape[-1]
        h = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], zoo.LN_EPS)
        y = _causal_attention(
            F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"]), heads, self.fused_attention
        )
        x = x + F.linear(y, p["attn.proj.weight"], p["attn.proj.bias"])
        h = F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"], zoo.LN_EPS)
        if "moe" in self.spec.attrs:  # mixture-of-experts feed-forward: torch_moe.py
            return x + torch_moe.moe_ffn(self, h)
        h = F.linear(
            F.relu(F.linear(h, p["ffn.fc1.weight"], p["ffn.fc1.bias"])),
            p["ffn.fc2.weight"],
            p["ffn.fc2.bias"],
        )
        return x + h

    def _tensor_parallel_block(self, x):
        """The block with this rank's heads and MLP slice (Megatron): f before the
        column-parallel layers, g after the row-parallel ones, biases after g."""
        p, heads = self.p, self.spec.attrs["n_heads"]  # this rank's heads
        d, tp = x.shape[-1], self.groups.tensor
        h = torch_tensor.copy_to_tensor_axis(
            F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], zoo.LN_EPS), tp
        )
        y = _causal_attention(
            F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"]), heads, self.fused_attention
        )
        out = torch_tensor.reduce_from_tensor_axis(F.linear(y, p["attn.proj.weight"]), tp)
        x = x + out + p["attn.proj.bias"]
        h = torch_tensor.copy_to_tensor_axis(
            F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"], zoo.LN_EPS), tp
        )
        if "moe" in self.spec.attrs:  # this rank's samples through the experts
            lo, hi = tp.my_rows(h.shape[0])
            router = torch_tensor.copy_to_tensor_axis(p["moe.router.weight"], tp)
            y = torch_moe.moe_ffn(self, h[lo:hi], router)
            y = F.pad(y, (0, 0, 0, 0, lo, h.shape[0] - hi))  # the other ranks' rows: 0
            return x + torch_tensor.reduce_from_tensor_axis(y, tp)
        h = F.relu(F.linear(h, p["ffn.fc1.weight"], p["ffn.fc1.bias"]))
        out = torch_tensor.reduce_from_tensor_axis(F.linear(h, p["ffn.fc2.weight"]), tp)
        return x + out + p["ffn.fc2.bias"]


class ZooNet(nn.Module):
    """A zoo model: the layers in order, parameters under their canonical names.
    `fused_attention` (None: where the tensors are on a GPU) is for the memory plan,
    whose fake CPU tensors trace a GPU rank's step (backends/torch_plan.py)."""

    def __init__(
        self, layers: list[zoo.LayerSpec], groups: ModelGroups | None = None, lazy_on=None,
        fused_attention: bool | None = None,
    ):  # fmt: skip
        super().__init__()
        self.seq = []
        for spec in layers:
            layer = _Layer(spec, groups, lazy_on, fused_attention)
            if "." in spec.name:
                parent, leaf = spec.name.rsplit(".", 1)
                _child(self, parent).add_module(leaf, layer)
            else:
                self.add_module(spec.name, layer)
            self.seq.append(layer)

    def forward(self, x):
        for layer in self.seq:
            if layer.spec.attrs.get("recompute") and torch.is_grad_enabled():
                # Activation checkpointing: keep the block's input, recompute the rest in
                # backward (non-reentrant: exact gradients, RNG state preserved).
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def build_model(
    model_cfg: dict,
    inp: zoo.InputSpec,
    seed: int,
    groups: ModelGroups | None = None,
    lazy_on: torch.device | None = None,
) -> nn.Module:
    """A zoo model with the canonical initial weights, or the user's own nn.Module.
    `groups`: the tensor axis and expert group from the process grid (none: one rank).
    `lazy_on` (zoo models, ZeRO-3): parameters on that device without memory and no
    initial values; the caller fills them from `init_stream`, one unit at a time."""
    name = model_cfg["name"]
    if zoo.is_zoo_model(name):
        groups = groups or ModelGroups()
        layers = zoo.build_layers(model_cfg, inp)
        mine_layers = local_layers(layers, seed, groups.experts)
        model = ZooNet(
            tensor_parallel.local_layers(mine_layers, groups.tensor.size), groups, lazy_on
        )
        if lazy_on is not None:
            return model
        mine = model.state_dict(keep_vars=True)
        unset = set(mine)
        with torch.no_grad():
            for key, part in init_stream(model_cfg, inp, seed, groups, set(mine)):
                mine[key].copy_(torch.from_numpy(part))
                unset.discard(key)
        if unset:  # a zoo layer whose tensors the canonical specs do not name: a bug
            raise RuntimeError(f"no initial value for {sorted(unset)[:3]}")
        return model
    from .torch_user import build_user_model  # import, call, one checked forward pass

    return build_user_model(model_cfg, inp, seed)
