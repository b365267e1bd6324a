"""`hpctrain ckpt export --to torchscript`: a zoo model as a TorchScript file.

The zoo's layer kinds (hpctrain/models/zoo.py) rebuilt from torch's standard modules
(nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding) plus three small
modules for what torch has no module for (global average pooling, a residual block, a
pre-LayerNorm causal transformer block), with the same forward pass as the training
backend's ZooNet and the same parameter names (`fc1.weight`, `layer1.0.bn1.running_var`,
`blocks.0.attn.qkv.weight`), so the `--to torch` state_dict also loads into it. The
module is compiled with `torch.jit.script` and saved with `torch.jit.save`: the file
holds the code and the weights, and `torch.jit.load` needs only torch (not hpctrain,
not these classes).
"""

from __future__ import annotations

import json
import math
import warnings
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models import zoo


class GlobalAvgPool(nn.Module):
    """[n, c, h, w] -> [n, c], the mean over the image (the zoo's `gap`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


class ConvBNReLU(nn.Module):
    """The resnet stem: relu(bn(conv(x))), a 3x3 convolution without bias."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=zoo.BN_EPS, momentum=zoo.BN_MOMENTUM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """He et al.'s basic block: two 3x3 conv + BN, a 1x1 conv + BN shortcut when the
    shape changes, relu(out + shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, eps=zoo.BN_EPS, momentum=zoo.BN_MOMENTUM)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, eps=zoo.BN_EPS, momentum=zoo.BN_MOMENTUM)
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                OrderedDict(
                    conv=nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                    bn=nn.BatchNorm2d(cout, eps=zoo.BN_EPS, momentum=zoo.BN_MOMENTUM),
                )
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TokenEmbedding(nn.Module):
    """Token plus learned position embeddings; positions 0..t-1 (t <= max_len)."""

    def __init__(self, vocab: int, max_len: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos.weight[: x.shape[1]]


class CausalSelfAttention(nn.Module):
    """Masked multi-head self-attention from packed q, k, v projections (GPT-2)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        n, t, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        dh = width // self.heads
        parts = qkv.split(width, -1)
        q = parts[0].reshape(n, t, self.heads, dh).transpose(1, 2)
        k = parts[1].reshape(n, t, self.heads, dh).transpose(1, 2)
        v = parts[2].reshape(n, t, self.heads, dh).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(n, t, width))


class FeedForward(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then + ffn(ln2(x))."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, eps=zoo.LN_EPS)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d, eps=zoo.LN_EPS)
        self.ffn = FeedForward(d, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


def _module(spec: zoo.LayerSpec) -> list[tuple[str, nn.Module]]:
    """(name, module) pairs for one zoo layer; the first carries the layer's name."""
    kind, p, a, leaf = spec.kind, spec.params, spec.attrs, spec.name.rsplit(".", 1)[-1]
    if kind == "flatten":
        return [(leaf, nn.Flatten(1))]
    if kind == "dense":
        out, cin = p["weight"]
        return [(leaf, nn.Linear(cin, out))] + ([(f"{leaf}_relu", nn.ReLU())] if a["relu"] else [])
    if kind == "conv":
        cout, cin, k, _ = p["weight"]
        conv = nn.Conv2d(cin, cout, k, a["stride"], a["padding"], bias="bias" in p)
        return [(leaf, conv)] + ([(f"{leaf}_relu", nn.ReLU())] if a["relu"] else [])
    if kind == "gap":
        return [(leaf, GlobalAvgPool())]
    if kind == "conv_bn":
        cout, cin = p["conv.weight"][:2]
        return [(leaf, ConvBNReLU(cin, cout, a["stride"]))]
    if kind == "resblock":
        cout, cin = p["conv1.weight"][:2]
        return [(leaf, BasicBlock(cin, cout, a["stride"]))]
    if kind == "embed":
        (vocab, d), max_len = p["tok.weight"], p["pos.weight"][0]
        return [(leaf, TokenEmbedding(vocab, max_len, d))]
    if kind == "layernorm":
        return [(leaf, nn.LayerNorm(p["weight"][0], eps=zoo.LN_EPS))]
    if kind == "block":
        ff, d = p["ffn.fc1.weight"]
        return [(leaf, TransformerBlock(d, a["n_heads"], ff))]
    raise ValueError(f"no torch module for the zoo's layer kind {kind!r}")


def build_module(layers: list[zoo.LayerSpec], flatten_first: bool = False) -> nn.Module:
    """An nn.Sequential of standard modules whose state_dict names are the zoo's
    canonical names: `layer1.0` becomes child `0` of an nn.Sequential `layer1`."""
    top: OrderedDict[str, nn.Module] = OrderedDict()
    if flatten_first and layers[0].kind != "flatten":
        top["flatten"] = nn.Flatten(1)  # an mlp takes any sample shape, flattened
    groups: dict[str, OrderedDict[str, nn.Module]] = {}
    for spec in layers:
        parent = spec.name.rsplit(".", 1)[0] if "." in spec.name else ""
        if "." in parent:
            raise ValueError(f"zoo layer {spec.name!r} is nested deeper than one level")
        target = top
        if parent:
            if parent not in groups:
                groups[parent] = OrderedDict()
                top[parent] = groups[parent]  # placeholder: the order of first appearance
            target = groups[parent]
        target.update(_module(spec))
    return nn.Sequential(
        OrderedDict(
            (k, nn.Sequential(v) if isinstance(v, OrderedDict) else v) for k, v in top.items()
        )
    )


def load_weights(module: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy the canonical weights in; every name and shape must match (torch's
    BatchNorm counter `num_batches_tracked`, which the zoo has not, stays 0)."""
    state = module.state_dict()
    wanted = {k for k in state if not k.endswith("num_batches_tracked")}
    missing, extra = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or extra:
        raise ValueError(f"weights do not fit the module: missing {missing[:3]}, extra {extra[:3]}")
    full = dict(state)
    for k in wanted:
        value = torch.from_numpy(np.array(weights[k], dtype=np.float32, copy=True))
        if tuple(value.shape) != tuple(state[k].shape):
            raise ValueError(f"{k}: shape {tuple(value.shape)}, module has {tuple(state[k].shape)}")
        full[k] = value
    module.load_state_dict(full, strict=True)


def save(
    layers: list[zoo.LayerSpec],
    weights: dict[str, np.ndarray],
    out,
    info: dict,
    flatten_first: bool = False,
) -> nn.Module:
    """Build, load, put in eval mode, script and save to `out`; returns the eager module."""
    module = build_module(layers, flatten_first)
    load_weights(module, weights)
    module.eval()
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; documented
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        scripted = torch.jit.script(module)
        torch.jit.save(scripted, str(out), _extra_files={"hpctrain.json": json.dumps(info)})
    return module
