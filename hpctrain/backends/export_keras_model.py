"""`hpctrain ckpt export --to keras-model`: a zoo model as a `.keras` file.

The zoo's layer kinds rebuilt as a functional Keras model from Keras's own layers only
(Dense, Conv2D, ZeroPadding2D, BatchNormalization, GlobalAveragePooling2D, Flatten,
Permute, Add, ReLU, Embedding, LayerNormalization, MultiHeadAttention) and two
`keras.ops` calls (the positions 0..t-1 of a token sequence), so
`keras.models.load_model` reads it in any Keras 3 with no custom objects and no
`safe_mode=False`. Layers carry the zoo's canonical names (`fc1`, `layer1.0.conv1`,
`blocks.0.attn`). The forward pass is the training backend's:

- inputs are what hpctrain's model takes: images NCHW (a Permute layer makes them
  NHWC for Keras's convolutions), token ids [n, t];
- torch's symmetric conv padding p is ZeroPadding2D(p) then a `padding="valid"` conv
  (Keras's "same" pads stride-2 convolutions on one side only);
- the transformer's packed q, k, v projection [3d, d] becomes MultiHeadAttention's
  query/key/value kernels [d, heads, d/heads] (head h owns rows h*dh..(h+1)*dh of each
  third), the output projection [d, d] its attention_output kernel [heads, d/heads, d].
"""

from __future__ import annotations

import numpy as np

from . import tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import keras
from keras import layers as kl

from ..models import zoo

_PAD_CONV = ("conv", "conv_bn", "resblock")


def _dense(w: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(w.T), b]


def _kernel(w: np.ndarray) -> np.ndarray:
    """torch conv weight [out, in, kh, kw] -> Keras kernel [kh, kw, in, out]."""
    return np.ascontiguousarray(w.transpose(2, 3, 1, 0))


class _Builder:
    """Applies zoo layers to a Keras tensor, remembering each Keras layer's weights."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.w = weights
        self.values: list[tuple[keras.layers.Layer, list[np.ndarray]]] = []

    def _set(self, layer, values):
        self.values.append((layer, [np.asarray(v, dtype=np.float32) for v in values]))
        return layer

    def conv(self, x, name, stride, pad, bias, relu=False):
        w = self.w[f"{name}.weight"]
        if pad:
            x = kl.ZeroPadding2D(pad, name=f"{name}_pad")(x)
        conv = kl.Conv2D(
            w.shape[0],
            w.shape[2:],
            strides=stride,
            padding="valid",
            use_bias=bias,
            activation="relu" if relu else None,
            name=name,
        )
        x = conv(x)
        values = [_kernel(w)] + ([self.w[f"{name}.bias"]] if bias else [])
        self._set(conv, values)
        return x

    def bn(self, x, name):
        layer = kl.BatchNormalization(epsilon=zoo.BN_EPS, momentum=1.0 - zoo.BN_MOMENTUM, name=name)
        x = layer(x)
        parts = ("weight", "bias", "running_mean", "running_var")
        self._set(layer, [self.w[f"{name}.{p}"] for p in parts])
        return x

    def dense(self, x, name, relu=False):
        w = self.w[f"{name}.weight"]
        layer = kl.Dense(w.shape[0], activation="relu" if relu else None, name=name)
        x = layer(x)
        self._set(layer, _dense(w, self.w[f"{name}.bias"]))
        return x

    def layernorm(self, x, name):
        layer = kl.LayerNormalization(epsilon=zoo.LN_EPS, name=name)
        x = layer(x)
        self._set(layer, [self.w[f"{name}.weight"], self.w[f"{name}.bias"]])
        return x

    def resblock(self, x, name, stride):
        out = self.conv(x, f"{name}.conv1", stride, 1, bias=False)
        out = kl.ReLU(name=f"{name}.relu1")(self.bn(out, f"{name}.bn1"))
        out = self.bn(self.conv(out, f"{name}.conv2", 1, 1, bias=False), f"{name}.bn2")
        if f"{name}.shortcut.conv.weight" in self.w:
            x = self.conv(x, f"{name}.shortcut.conv", stride, 0, bias=False)
            x = self.bn(x, f"{name}.shortcut.bn")
        return kl.ReLU(name=f"{name}.relu")(kl.Add(name=f"{name}.add")([out, x]))

    def embed(self, x, name):
        tok, pos = self.w[f"{name}.tok.weight"], self.w[f"{name}.pos.weight"]
        t = kl.Embedding(tok.shape[0], tok.shape[1], name=f"{name}.tok")
        p = kl.Embedding(pos.shape[0], pos.shape[1], name=f"{name}.pos")
        positions = keras.ops.cumsum(keras.ops.ones_like(x), axis=1) - 1  # 0..t-1 per row
        y = kl.Add(name=f"{name}.add")([t(x), p(positions)])
        self._set(t, [tok])
        self._set(p, [pos])
        return y

    def block(self, x, name, heads):
        qkv_w, qkv_b = self.w[f"{name}.attn.qkv.weight"], self.w[f"{name}.attn.qkv.bias"]
        proj_w, proj_b = self.w[f"{name}.attn.proj.weight"], self.w[f"{name}.attn.proj.bias"]
        d = proj_w.shape[0]
        dh = d // heads
        h = self.layernorm(x, f"{name}.ln1")
        attn = kl.MultiHeadAttention(heads, dh, name=f"{name}.attn")
        y = attn(h, h, use_causal_mask=True)
        values = []
        for i in range(3):  # query, key, value: rows i*d..(i+1)*d of the packed projection
            w, b = qkv_w[i * d : (i + 1) * d], qkv_b[i * d : (i + 1) * d]
            values += [w.T.reshape(d, heads, dh), b.reshape(heads, dh)]
        values += [proj_w.T.reshape(heads, dh, d), proj_b]
        self._set(attn, values)
        x = kl.Add(name=f"{name}.add1")([x, y])
        h = self.layernorm(x, f"{name}.ln2")
        h = self.dense(self.dense(h, f"{name}.ffn.fc1", relu=True), f"{name}.ffn.fc2")
        return kl.Add(name=f"{name}.add2")([x, h])


def build(
    layers: list[zoo.LayerSpec], weights: dict[str, np.ndarray], inp: zoo.InputSpec, name: str
) -> keras.Model:
    """The functional Keras model of `layers` with `weights` (canonical names, torch
    layouts) set; inputs as hpctrain's model takes them (`inp.shape` per sample)."""
    if inp.tokens:
        x = inputs = keras.Input((None,), dtype="int32", name="tokens")
    else:
        x = inputs = keras.Input(tuple(inp.shape), dtype="float32", name="x")
    b = _Builder(weights)
    nchw = len(inp.shape) == 3
    if name == "mlp" and len(inp.shape) > 1:
        x = kl.Flatten(data_format="channels_last", name="flatten")(x)  # C, H, W order
    for spec in layers:
        kind, a, n = spec.kind, spec.attrs, spec.name
        if nchw and kind in (*_PAD_CONV, "gap"):
            x, nchw = kl.Permute((2, 3, 1), name="nchw_to_nhwc")(x), False
        if kind == "flatten":
            continue  # done above, before the first layer
        if kind == "dense":
            x = b.dense(x, n, relu=a["relu"])
        elif kind == "conv":
            x = b.conv(x, n, a["stride"], a["padding"], "bias" in spec.params, relu=a["relu"])
        elif kind == "gap":
            x = kl.GlobalAveragePooling2D(name=n)(x)
        elif kind == "conv_bn":
            x = b.bn(b.conv(x, f"{n}.conv", a["stride"], 1, bias=False), f"{n}.bn")
            x = kl.ReLU(name=f"{n}.relu")(x)
        elif kind == "resblock":
            x = b.resblock(x, n, a["stride"])
        elif kind == "embed":
            x = b.embed(x, n)
        elif kind == "layernorm":
            x = b.layernorm(x, n)
        elif kind == "block":
            x = b.block(x, n, a["n_heads"])
        else:
            raise ValueError(f"no Keras layers for the zoo's layer kind {kind!r}")
    model = keras.Model(inputs, x, name=f"hpctrain_{name}")
    for layer, values in b.values:
        layer.set_weights(values)
    return model


def save(
    layers: list[zoo.LayerSpec],
    weights: dict[str, np.ndarray],
    inp: zoo.InputSpec,
    name: str,
    out,
) -> keras.Model:
    model = build(layers, weights, inp, name)
    model.save(str(out))
    return model
