"""The model zoo, described once without any framework.

A zoo model is a sequence of `LayerSpec`s (kind, name, parameter shapes, attributes).
Each backend interprets the same few layer kinds, so torch and TensorFlow run the same
architecture with the same canonical parameter names (`<layer>.<param>`, torch's
layouts: dense weight [out, in], conv weight [out, in, kh, kw]). Initial weights are
drawn here with numpy from the run's seed, so both backends start bit-identical.
The sequence is also what pipeline parallelism cuts into stages.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..moe.options import is_moe_block, moe_options, validate_moe

# Options of each zoo model and their defaults; `model.<option>` in the config.
MODEL_OPTIONS: dict[str, dict] = {
    "mlp": {"hidden": [128, 128]},
    "cnn": {"channels": [16, 32, 64]},
    "resnet": {"depth": 8, "width": 16},
    "transformer": {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 128,
        "moe": None,
        "checkpoint_activations": False,
    },
}
# Options that are switches (true/false), not sizes.
BOOL_OPTIONS = ("checkpoint_activations",)
# The data task each zoo model expects.
MODEL_TASK = {
    "mlp": ("vectors", "images"),
    "cnn": ("images",),
    "resnet": ("images",),
    "transformer": ("tokens",),
}


@dataclass(frozen=True)
class InputSpec:
    """What the data looks like: sample shape, dtype kind and number of classes."""

    shape: tuple[int, ...]  # one sample, e.g. (32,), (3, 16, 16) or (seq_len,)
    classes: int  # classes, or vocabulary size for language modelling
    tokens: bool = False  # integer token ids (language modelling)


@dataclass
class LayerSpec:
    """One layer: `params` maps a local parameter name to its shape (buffers separately)."""

    kind: str
    name: str
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.params.values())  # exact past int64 too


def is_zoo_model(name: str) -> bool:
    return name in MODEL_OPTIONS


def model_options(model_cfg: dict) -> dict:
    """The zoo model's options with defaults filled in."""
    opts = dict(MODEL_OPTIONS[model_cfg["name"]])
    opts.update({k: v for k, v in model_cfg.items() if k != "name"})
    return opts


def written_model(model_cfg: dict) -> dict:
    """The model section as a run records it (config.yaml) and a resume compares it: a
    zoo model's options with their defaults, and its MoE block's, filled in, so that a
    default changed by a later version cannot build another model unnoticed, nor a
    default written out differ from the same default left out. A user model's as given."""
    name = model_cfg.get("name")
    if not isinstance(name, str) or not is_zoo_model(name):
        return dict(model_cfg)
    opts = model_options(model_cfg)
    if isinstance(opts.get("moe"), dict):
        opts["moe"] = moe_options(opts["moe"])
    elif "moe" in opts and opts["moe"] is None:
        del opts["moe"]  # off: left out (a later --set model.moe.experts=8 makes it)
    return {"name": name, **opts}


def has_moe(model_cfg: dict) -> bool:
    """True when the model has mixture-of-experts blocks (a `moe` option is set: `{}`
    too, every MoE option at its default, as the layers read it)."""
    return model_cfg.get("moe") is not None


def validate_model_options(model_cfg: dict) -> list[str]:
    """Problems with the `model` section, each naming its key."""
    name = model_cfg.get("name")
    if not isinstance(name, str) or not name:
        return ["model.name: required (one of mlp, cnn, resnet, transformer, or pkg.module:fn)"]
    if not is_zoo_model(name):
        if ":" not in name:
            return [
                f"model.name: {name!r} is not a zoo model (mlp, cnn, resnet, transformer) "
                "nor a 'package.module:function' reference"
            ]
        return []  # a user model: its options are passed to the builder as keyword args
    problems = []
    known = MODEL_OPTIONS[name]
    for key, value in model_cfg.items():
        if key == "name":
            continue
        if key not in known:
            owners = [m for m, opts in MODEL_OPTIONS.items() if key in opts and m != name]
            # a section set whole from the command line drops the file's other options
            replace = f"--set 'model={{name: {name}}}'"
            hint = (
                f"; it is an option of {' and '.join(owners)}: remove it (on the command "
                f"line, {replace} replaces the whole section)"
                if owners
                else ""
            )
            problems.append(
                f"model.{key}: not an option of {name} (its options: "
                f"{', '.join(sorted(known))}){hint}"
            )
            continue
        default = known[key]
        if key == "moe":  # nested mapping: hpctrain/moe/options.py
            problems += validate_moe(value)
        elif key in BOOL_OPTIONS:
            if not isinstance(value, bool):
                problems.append(f"model.{key}: expected true or false, got {value!r}")
        elif isinstance(default, list):
            if not (
                isinstance(value, list)
                and value
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
            ):
                problems.append(
                    f"model.{key}: expected a non-empty list of positive integers, got {value!r}"
                )
        elif not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            problems.append(f"model.{key}: expected a positive integer, got {value!r}")
    if problems:
        return problems
    opts = model_options(model_cfg)
    if name == "resnet" and (opts["depth"] - 2) % 6 != 0:
        problems.append(
            f"model.depth: resnet depth must be 6n+2 (8, 14, 20, 32, ...), got {opts['depth']}"
        )
    if name == "transformer" and opts["checkpoint_activations"] and has_moe(opts):
        problems.append(
            "model.checkpoint_activations: not with model.moe (the router's balancing loss "
            "is recorded during the forward pass; recomputing it would count it twice)"
        )
    moe = moe_options(opts.get("moe"))
    if name == "transformer" and moe and moe["every"] > opts["n_layers"]:
        problems.append(
            f"model.moe.every={moe['every']} puts experts in no block of the "
            f"{opts['n_layers']} (model.n_layers): the model would train dense; set every "
            f"to at most {opts['n_layers']}, or model.moe: null"
        )
    if name == "transformer" and opts["d_model"] % opts["n_heads"] != 0:
        problems.append(
            f"model.n_heads: d_model={opts['d_model']} is not divisible by "
            f"n_heads={opts['n_heads']}"
        )
    return problems


def param_count(model_cfg: dict, inp: InputSpec) -> int | None:
    """A zoo model's parameter count from its layer shapes (nothing allocated); None for
    a user's model."""
    if not is_zoo_model(model_cfg["name"]):
        return None
    return sum(spec.param_count() for spec in build_layers(model_cfg, inp))


def build_layers(model_cfg: dict, inp: InputSpec) -> list[LayerSpec]:
    """The layer sequence of a zoo model for inputs described by `inp`."""
    name = model_cfg["name"]
    opts = model_options(model_cfg)
    builder = {"mlp": _mlp, "cnn": _cnn, "resnet": _resnet, "transformer": _transformer}[name]
    return builder(opts, inp)


def _dense(name, fan_in, fan_out, relu):
    return LayerSpec(
        "dense", name, {"weight": (fan_out, fan_in), "bias": (fan_out,)}, attrs={"relu": relu}
    )


def _mlp(opts, inp: InputSpec) -> list[LayerSpec]:
    layers = [LayerSpec("flatten", "flatten")] if len(inp.shape) > 1 else []
    width = int(np.prod(inp.shape))
    for i, h in enumerate(opts["hidden"]):
        layers.append(_dense(f"fc{i + 1}", width, h, relu=True))
        width = h
    layers.append(_dense("head", width, inp.classes, relu=False))
    return layers


def _conv(name, cin, cout, k, stride, relu, bias=True):
    params = {"weight": (cout, cin, k, k)}
    if bias:
        params["bias"] = (cout,)
    return LayerSpec(
        "conv", name, params, attrs={"stride": stride, "padding": k // 2, "relu": relu}
    )


def _cnn(opts, inp: InputSpec) -> list[LayerSpec]:
    if len(inp.shape) != 3:
        raise ValueError(f"cnn needs images (C, H, W), got sample shape {inp.shape}")
    layers, cin = [], inp.shape[0]
    for i, c in enumerate(opts["channels"]):
        layers.append(_conv(f"conv{i + 1}", cin, c, 3, 1 if i == 0 else 2, relu=True))
        cin = c
    layers.append(LayerSpec("gap", "pool"))
    layers.append(_dense("head", cin, inp.classes, relu=False))
    return layers


def _bn(cout):
    return ({"weight": (cout,), "bias": (cout,)}, {"running_mean": (cout,), "running_var": (cout,)})


def _resnet(opts, inp: InputSpec) -> list[LayerSpec]:
    """CIFAR-style ResNet (He et al. 2016, sec. 4.2): 3 stages of n basic blocks."""
    if len(inp.shape) != 3:
        raise ValueError(f"resnet needs images (C, H, W), got sample shape {inp.shape}")
    n = (opts["depth"] - 2) // 6
    w = opts["width"]
    bn_p, bn_b = _bn(w)
    stem = LayerSpec(
        "conv_bn",
        "stem",
        {"conv.weight": (w, inp.shape[0], 3, 3), **{f"bn.{k}": s for k, s in bn_p.items()}},
        {f"bn.{k}": s for k, s in bn_b.items()},
        {"stride": 1},
    )
    layers, cin = [stem], w
    for stage in range(3):
        cout = w * 2**stage
        for b in range(n):
            stride = 2 if (stage > 0 and b == 0) else 1
            params = {"conv1.weight": (cout, cin, 3, 3), "conv2.weight": (cout, cout, 3, 3)}
            buffers = {}
            for bn in ("bn1", "bn2") + (("shortcut.bn",) if stride != 1 or cin != cout else ()):
                p, bf = _bn(cout)
                params.update({f"{bn}.{k}": s for k, s in p.items()})
                buffers.update({f"{bn}.{k}": s for k, s in bf.items()})
            if stride != 1 or cin != cout:
                params["shortcut.conv.weight"] = (cout, cin, 1, 1)
            layers.append(
                LayerSpec("resblock", f"layer{stage + 1}.{b}", params, buffers, {"stride": stride})
            )
            cin = cout
    layers.append(LayerSpec("gap", "pool"))
    layers.append(_dense("head", cin, inp.classes, relu=False))
    return layers


def _transformer(opts, inp: InputSpec) -> list[LayerSpec]:
    """A small pre-LayerNorm causal language model (GPT-2 style)."""
    if not inp.tokens:
        raise ValueError("transformer needs token data (data.task: tokens)")
    d, seq, vocab, ff = opts["d_model"], inp.shape[0], inp.classes, opts["d_ff"]
    layers = [LayerSpec("embed", "embed", {"tok.weight": (vocab, d), "pos.weight": (seq, d)})]
    moe = moe_options(opts["moe"])
    for i in range(opts["n_layers"]):
        ffn = {"fc1.weight": (ff, d), "fc1.bias": (ff,), "fc2.weight": (d, ff), "fc2.bias": (d,)}
        if is_moe_block(moe, i):  # router + E experts with global indices (all ranks' experts)
            mlp = {f"moe.experts.{e}.{k}": s for e in range(moe["experts"]) for k, s in ffn.items()}
            mlp = {"moe.router.weight": (moe["experts"], d), **mlp}
        else:
            mlp = {f"ffn.{k}": s for k, s in ffn.items()}
        layers.append(
            LayerSpec(
                "block",
                f"blocks.{i}",
                {
                    "ln1.weight": (d,),
                    "ln1.bias": (d,),
                    "attn.qkv.weight": (3 * d, d),
                    "attn.qkv.bias": (3 * d,),
                    "attn.proj.weight": (d, d),
                    "attn.proj.bias": (d,),
                    "ln2.weight": (d,),
                    "ln2.bias": (d,),
                    **mlp,
                },
                attrs={
                    "n_heads": opts["n_heads"],
                    **({"moe": moe} if "moe.router.weight" in mlp else {}),
                    # Keep only the block's input; recompute its insides during backward.
                    **({"recompute": True} if opts["checkpoint_activations"] else {}),
                },
            )
        )
    layers.append(LayerSpec("layernorm", "ln_f", {"weight": (d,), "bias": (d,)}))
    layers.append(
        LayerSpec("dense", "head", {"weight": (vocab, d), "bias": (vocab,)}, attrs={"relu": False})
    )
    return layers


def init_weights(layers: list[LayerSpec], seed: int) -> OrderedDict[str, np.ndarray]:
    """Canonical float32 initial values of every parameter and buffer, from `seed`."""
    return OrderedDict(iter_init_weights(layers, seed))


def iter_init_weights(layers: list[LayerSpec], seed: int):
    """(name, canonical float32 initial value) one tensor at a time, from `seed`.

    He-normal for weights feeding a ReLU, fan-in uniform (torch's Linear default bound)
    otherwise; zero biases; unit norm scales; N(0, 0.02) embeddings (GPT-2). One at a
    time, so a rank that keeps only its tensor-parallel piece never holds the whole model.
    """
    rng = np.random.default_rng(seed)
    for layer in layers:
        for pname, shape in layer.params.items():
            full = f"{layer.name}.{pname}"
            leaf = pname.rsplit(".", 1)[-1]
            parent = pname.rsplit(".", 1)[0] if "." in pname else ""
            if leaf == "bias":
                value = np.zeros(shape, dtype=np.float32)
            elif (
                parent.endswith(("bn", "bn1", "bn2"))
                or parent.startswith("ln")
                or layer.kind == "layernorm"
            ):
                value = np.ones(shape, dtype=np.float32)
            elif layer.kind == "embed":
                value = _drawn(rng.normal, 0.0, 0.02, shape)
            else:
                fan_in = int(np.prod(shape[1:]))
                relu_after = layer.attrs.get("relu", layer.kind in ("resblock", "conv_bn")) or (
                    layer.kind == "block" and parent.endswith("fc1")
                )
                if relu_after:
                    value = _drawn(rng.normal, 0.0, math.sqrt(2.0 / fan_in), shape)
                else:
                    bound = 1.0 / math.sqrt(fan_in)
                    value = _drawn(rng.uniform, -bound, bound, shape)
            yield full, value
            del value
        for bname, shape in layer.buffers.items():
            fill = 1.0 if bname.endswith("running_var") else 0.0
            yield f"{layer.name}.{bname}", np.full(shape, fill, dtype=np.float32)


def iter_layer_weights(layers: list[LayerSpec], seed: int):
    """Each layer's {name: initial value} in order, one layer at a time (the values of
    iter_init_weights, which draws a layer's parameters, then its buffers)."""
    stream = iter_init_weights(layers, seed)
    for layer in layers:
        yield dict(itertools.islice(stream, len(layer.params) + len(layer.buffers)))


DRAW_CHUNK = 1 << 20  # elements drawn at a time (an 8 MiB float64 temporary)


def _drawn(draw, a: float, b: float, shape) -> np.ndarray:
    """float32 values of `shape` from `draw(a, b, size)` (a Generator's normal or
    uniform), drawn DRAW_CHUNK elements at a time: the values of one draw of the whole
    (a Generator's stream does not depend on how it is cut), without its float64
    temporary of twice the tensor (1.6 GB for a 50k x 4096 embedding)."""
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    for i in range(0, flat.size, DRAW_CHUNK):
        flat[i : i + DRAW_CHUNK] = draw(a, b, size=min(DRAW_CHUNK, flat.size - i))
    return out


def tensor_shapes(layers: list[LayerSpec]) -> OrderedDict[str, tuple]:
    """Every parameter's and buffer's canonical name and shape, in iter_init_weights'
    order, without a value."""
    return OrderedDict(
        (f"{layer.name}.{name}", tuple(shape))
        for layer in layers
        for table in (layer.params, layer.buffers)
        for name, shape in table.items()
    )


def param_names(layers: list[LayerSpec]) -> list[str]:
    """Trainable parameter names in order (buffers excluded)."""
    return [f"{layer.name}.{p}" for layer in layers for p in layer.params]


def buffer_names(layers: list[LayerSpec]) -> list[str]:
    return [f"{layer.name}.{b}" for layer in layers for b in layer.buffers]


BN_EPS = 1e-5
BN_MOMENTUM = 0.1  # torch's convention: running = (1 - m) * running + m * batch
LN_EPS = 1e-5
