"""Zoo models on raw tf ops: the zoo's layer kinds interpreted with tf, canonical-name
variables, a forward pass equal to torch's, each rank keeping its experts and its
tensor-parallel pieces (the groups come from the process grid: backends/groups.py)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import tf_env, tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..models import zoo
from ..moe.parallel import is_expert_param, local_layers
from ..tensor import parallel as tensor_parallel
from . import tensorflow_moe
from .base import EvalStats
from .groups import ModelGroups


def dense_grads(grads, variables) -> list:
    """`tape.gradient`'s result as dense tensors: embeddings give IndexedSlices, and a
    variable off the loss's path (a user's unused layer) None, which becomes zeros, so
    every rank exchanges and steps the same list (torch leaves such a gradient None)."""
    return [
        tf.zeros(tuple(v.shape), tf.as_dtype(v.dtype)) if g is None else tf.convert_to_tensor(g)
        for g, v in zip(grads, variables)
    ]


def traced(fn, net):
    """`fn` as one tf.function. AutoGraph (rewriting Python `if`/`for` on tensors into
    graph ops) stays on only for a user's model, whose code may need it: hpctrain's own
    step and zoo models branch on Python values alone, and AutoGraph's transpiling cost
    each rank 2.2 s of CPU per run (measured, the tiny transformer: 13.1 -> 10.9 s, same
    losses)."""
    from .tensorflow_user import KerasUserNet

    return tf.function(fn, reduce_retracing=True, autograph=isinstance(net, KerasUserNet))


def eval_sums(net, x, y):
    """Summed loss and correct predictions of one batch (traced by tf.function)."""
    return logit_sums(tf.cast(net(x, training=False), tf.float32), y)  # bf16: loss in f32


def logit_sums(logits, y):
    """Summed cross-entropy and correct predictions of float32 `logits` for labels `y`."""
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.int64))
    return tf.reduce_sum(losses), correct


def evaluate_with(eval_fn, x, y) -> EvalStats:
    loss, correct = eval_fn(tf.constant(x), tf.constant(y))
    return EvalStats(float(loss), int(correct), int(np.prod(y.shape)))


def net_weights(net) -> OrderedDict[str, np.ndarray]:
    """A ZooNet's parameters and buffers under canonical names."""
    out = OrderedDict((k, v.numpy().copy()) for k, v in net.vars.items())
    out.update((k, v.numpy().copy()) for k, v in net.buffers.items())
    return out


def assign_weights(net, weights: dict[str, np.ndarray]) -> None:
    for k, v in list(net.vars.items()) + list(net.buffers.items()):
        v.assign(np.asarray(weights[k], dtype=np.float32))


# --- the zoo's layer kinds, interpreted with tf ops ---------------------------------
def _conv(x, w, b, stride, pad):
    """x NHWC, w canonical [out, in, kh, kw]; symmetric padding as torch does."""
    if pad:
        x = tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    y = tf.nn.conv2d(x, tf.transpose(w, [2, 3, 1, 0]), strides=stride, padding="VALID")
    return y if b is None else y + b


def _dense(x, w, b):
    return tf.linalg.matmul(tf.cast(x, w.dtype), w, transpose_b=True) + b


def _tensor_allreduce(group, x, what: str):
    """Sum over the tensor axis inside a traced function (a stateful numpy_function:
    tf.function keeps stateful ops in program order, so every rank issues the
    collectives in the same order)."""
    y = tf.numpy_function(
        lambda a: group.allreduce_sum(a, what), [tf.cast(x, tf.float32)], tf.float32
    )
    y.set_shape(x.shape)
    return tf.cast(y, x.dtype)


def tensor_axis_ops(group):
    """Megatron's f and g over tensor group `group` (one pair per model)."""

    @tf.custom_gradient
    def copy_to_tensor_axis(x):
        """f: identity forward, allreduce of the gradient backward."""
        return tf.identity(x), lambda dy: _tensor_allreduce(group, dy, "input gradient (f)")

    @tf.custom_gradient
    def reduce_from_tensor_axis(x):
        """g: allreduce forward, identity backward."""
        return _tensor_allreduce(group, x, "partial output (g)"), lambda dy: tf.identity(dy)

    return copy_to_tensor_axis, reduce_from_tensor_axis


def _causal_attention(qkv, n, t, heads):
    """Masked self-attention of `heads` heads from the packed q, k, v projections
    [n, t, 3 * heads * dh]; returns [n, t, heads * dh]."""
    width = qkv.shape[-1] // 3
    dh = width // heads

    def heads_first(z):
        return tf.transpose(tf.reshape(z, [n, t, heads, dh]), [0, 2, 1, 3])

    q, k, val = (heads_first(z) for z in tf.split(qkv, 3, axis=-1))
    scores = tf.linalg.matmul(q, k, transpose_b=True) / float(np.sqrt(dh))
    future = tf.linalg.band_part(tf.ones([t, t]), 0, -1) - tf.linalg.band_part(
        tf.ones([t, t]), 0, 0
    )
    scores = tf.where(future > 0, tf.constant(float("-inf"), scores.dtype), scores)
    att = tf.nn.softmax(scores, axis=-1)
    return tf.reshape(tf.transpose(tf.linalg.matmul(att, val), [0, 2, 1, 3]), [n, t, width])


def _layer_norm(x, w, b):
    x = tf.cast(x, w.dtype)  # bf16: float32 weights, so float32 (as torch's autocast)
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) / tf.sqrt(var + zoo.LN_EPS) * w + b


_BIASES_AFTER_REDUCTION = ("attn.proj.bias", "ffn.fc2.bias")

# A unit run again inside backward (ZeRO-3, tensorflow_zero3.py): BatchNorm normalises
# with the batch's statistics, as training does, but leaves the running ones alone (the
# first forward updated them).
RECOMPUTE = "recompute"
_CHANNELS_LAST = ("conv", "conv_bn", "resblock", "gap")  # the kinds that convolve NHWC


def images_first(layers: list[zoo.LayerSpec], image: bool) -> list[bool]:
    """Whether the activation entering each layer is still NCHW (the canonical image
    layout), for a run that starts part-way through the model (a ZeRO-3 unit)."""
    out, nchw = [], image
    for spec in layers:
        out.append(nchw)
        nchw = nchw and spec.kind not in _CHANNELS_LAST
    return out


class ZooNet(tf.Module):
    """A zoo model: canonical-name variables and a forward pass equal to torch's.

    `sharded` (ZeRO-3): the names of parameters kept elsewhere as shards; they get no
    variable here, and `run_layers` takes their values from its caller."""

    def __init__(
        self, layers: list[zoo.LayerSpec], weights: dict, bf16=False, groups=None, sharded=()
    ):
        super().__init__(name="zoo")
        self.layers = layers
        self.groups = groups or ModelGroups()  # tensor axis and experts, from the grid
        self._f, self._g = tensor_axis_ops(self.groups.tensor)
        # bf16: the forward pass computes in bfloat16 on casts of the float32 variables
        # (their gradients come back float32); BatchNorm statistics stay float32.
        self.compute_dtype = tf.bfloat16 if bf16 else tf.float32
        self.shapes = OrderedDict(  # every parameter's (local) shape, in canonical order
            (f"{spec.name}.{p}", tuple(shape))
            for spec in layers
            for p, shape in spec.params.items()
        )
        self.vars: OrderedDict[str, tf.Variable] = OrderedDict()
        self.buffers: OrderedDict[str, tf.Variable] = OrderedDict()
        for spec in layers:
            for p, shape in spec.params.items():
                key = f"{spec.name}.{p}"
                if key not in sharded:  # absent from `weights`: filled by the caller
                    value = weights[key] if key in weights else np.zeros(shape, np.float32)
                    self.vars[key] = tf.Variable(value, name=key.replace(".", "/"))
            for bname, shape in spec.buffers.items():
                key = f"{spec.name}.{bname}"
                value = weights[key] if key in weights else np.zeros(shape, np.float32)
                self.buffers[key] = tf.Variable(value, trainable=False, name=key.replace(".", "/"))

    def _bn(self, x, prefix, training, v):
        if x.dtype != tf.float32:
            return tf.cast(self._bn(tf.cast(x, tf.float32), prefix, training, v), x.dtype)
        w, b = v[f"{prefix}.weight"], v[f"{prefix}.bias"]
        rm, rv = self.buffers[f"{prefix}.running_mean"], self.buffers[f"{prefix}.running_var"]
        if not training:
            return (x - rm) / tf.sqrt(rv + zoo.BN_EPS) * w + b
        mean, var = tf.nn.moments(x, axes=[0, 1, 2])
        if training is not RECOMPUTE:
            n = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), x.dtype)
            m = zoo.BN_MOMENTUM
            rm.assign((1 - m) * rm + m * mean)
            rv.assign((1 - m) * rv + m * var * n / (n - 1))  # torch keeps the unbiased variance
        return (x - mean) / tf.sqrt(var + zoo.BN_EPS) * w + b

    def own_values(self, spec) -> dict:
        """A layer's parameters from this net's variables, by local name."""
        return {p: self.vars[f"{spec.name}.{p}"] for p in spec.params}

    def cast_in(self, x):
        low = self.compute_dtype != tf.float32
        return tf.cast(x, self.compute_dtype) if low and x.dtype.is_floating else x

    def cast_out(self, x):
        return tf.cast(x, tf.float32) if self.compute_dtype != tf.float32 else x

    def __call__(self, x, training=False):
        nchw = len(x.shape) == 4  # images arrive NCHW (canonical); TF convolves NHWC
        x = self.run_layers(self.cast_in(x), self.layers, self.own_values, training, nchw)
        return self.cast_out(x)

    def run_layers(self, x, layers, values, training, nchw: bool):
        """`layers` in order from activation `x` (NCHW while `nchw`), each layer's
        parameters from `values(spec)`; training is False, True or RECOMPUTE."""
        low = self.compute_dtype != tf.float32
        for spec in layers:
            raw = values(spec)  # float32: BatchNorm's scales stay float32 under bf16
            v = {p: self._compute_value(spec, p, w) for p, w in raw.items()} if low else raw
            if spec.kind in _CHANNELS_LAST and nchw:
                x, nchw = tf.transpose(x, [0, 2, 3, 1]), False
            x = self._layer(spec, x, v, training, self._prefixed(spec, raw))
        return x

    def _compute_value(self, spec, param: str, w):
        """bf16: what torch's autocast on a CPU computes with, so the backends agree:
        embeddings and layer norms stay float32 (and so does the residual stream they
        feed), as do the biases a tensor-parallel block adds after its reduction;
        matmuls and convolutions take bfloat16 copies."""
        keep = spec.kind in ("embed", "layernorm") or (
            spec.kind == "block"
            and (
                param.startswith(("ln1.", "ln2."))
                or (spec.attrs.get("tensor", 1) > 1 and param in _BIASES_AFTER_REDUCTION)
            )
        )
        return w if keep else tf.cast(w, self.compute_dtype)

    def _layer(self, spec, x, v, training, full):
        """One layer; `full`: its float32 values under full names (BatchNorm's)."""
        kind, a = spec.kind, spec.attrs
        if kind == "flatten":
            return tf.reshape(x, [tf.shape(x)[0], -1])
        if kind == "dense":
            x = _dense(x, v["weight"], v["bias"])
            return tf.nn.relu(x) if a["relu"] else x
        if kind == "conv":
            x = _conv(x, v["weight"], v.get("bias"), a["stride"], a["padding"])
            return tf.nn.relu(x) if a["relu"] else x
        if kind == "gap":
            return tf.reduce_mean(x, axis=[1, 2])
        if kind == "conv_bn":
            y = _conv(x, v["conv.weight"], None, a["stride"], 1)
            return tf.nn.relu(self._bn(y, f"{spec.name}.bn", training, full))
        if kind == "resblock":
            return self._resblock(x, spec, v, training, full)
        if kind == "embed":
            return tf.gather(v["tok.weight"], x) + v["pos.weight"][: tf.shape(x)[1]]
        if kind == "layernorm":
            return _layer_norm(x, v["weight"], v["bias"])
        if kind == "block" and a.get("recompute") and training:
            return self._recomputed_block(x, v, a["n_heads"], spec)
        if kind == "block":
            return self._block(x, v, a["n_heads"], spec, training)
        raise ValueError(f"unknown layer kind {kind!r}")

    @staticmethod
    def _prefixed(spec, v) -> dict:
        """A layer's values under full names (`<layer>.<param>`), for BatchNorm."""
        return {f"{spec.name}.{p}": w for p, w in v.items()}

    def _resblock(self, x, spec, v, training, full):
        s, n = spec.attrs["stride"], spec.name
        y = _conv(x, v["conv1.weight"], None, s, 1)
        out = tf.nn.relu(self._bn(y, f"{n}.bn1", training, full))
        out = self._bn(_conv(out, v["conv2.weight"], None, 1, 1), f"{n}.bn2", training, full)
        if "shortcut.conv.weight" in v:
            y = _conv(x, v["shortcut.conv.weight"], None, s, 0)
            x = self._bn(y, f"{n}.shortcut.bn", training, full)
        return tf.nn.relu(out + x)

    def _recomputed_block(self, x, v, heads, spec):
        """Activation checkpointing: only the block's input is kept for backward; the
        block runs again inside the gradient (tf.recompute_grad), giving exact gradients.
        The parameters go in as arguments: recompute_grad differentiates its arguments
        and the variables it sees, not tensors a closure captured (ZeRO-3's)."""
        names = list(v)

        def block(t, *weights):
            return self._block(t, dict(zip(names, weights, strict=True)), heads, spec, True)

        return tf.recompute_grad(block)(x, *v.values())

    def _block(self, x, v, heads, spec=None, training=False):
        if spec is not None and spec.attrs.get("tensor", 1) > 1:
            return self._tensor_parallel_block(x, v, heads, spec, training)
        shape = tf.shape(x)
        n, t = shape[0], shape[1]
        h = _layer_norm(x, v["ln1.weight"], v["ln1.bias"])
        y = _causal_attention(_dense(h, v["attn.qkv.weight"], v["attn.qkv.bias"]), n, t, heads)
        x = x + tf.cast(_dense(y, v["attn.proj.weight"], v["attn.proj.bias"]), x.dtype)
        h = _layer_norm(x, v["ln2.weight"], v["ln2.bias"])
        if spec is not None and "moe" in spec.attrs:  # mixture of experts: tensorflow_moe.py
            return x + tensorflow_moe.moe_ffn(self, spec, v, h, training)
        h = _dense(
            tf.nn.relu(_dense(h, v["ffn.fc1.weight"], v["ffn.fc1.bias"])),
            v["ffn.fc2.weight"],
            v["ffn.fc2.bias"],
        )
        return x + tf.cast(h, x.dtype)  # bf16: the residual stream stays float32

    def _tensor_parallel_block(self, x, v, heads, spec, training):
        """The block with this rank's heads and MLP slice (Megatron): f before the
        column-parallel layers, g after the row-parallel ones, biases after g; with
        experts, this rank's samples through them (tensor/parallel.py)."""
        shape = tf.shape(x)
        n, t = shape[0], shape[1]
        f, g = self._f, self._g
        h = f(_layer_norm(x, v["ln1.weight"], v["ln1.bias"]))
        y = _causal_attention(_dense(h, v["attn.qkv.weight"], v["attn.qkv.bias"]), n, t, heads)
        out = tf.linalg.matmul(y, v["attn.proj.weight"], transpose_b=True)
        x = x + tf.cast(g(out), x.dtype) + v["attn.proj.bias"]
        h = f(_layer_norm(x, v["ln2.weight"], v["ln2.bias"]))
        if spec is not None and "moe" in spec.attrs:  # this rank's samples, to the experts
            lo, hi = self.groups.tensor.my_rows(n)
            router = f(v["moe.router.weight"])
            y = tensorflow_moe.moe_ffn(self, spec, v, h[lo:hi], training, router)
            y = tf.pad(y, [[lo, n - hi], [0, 0], [0, 0]])  # the other ranks' rows: 0
            return x + g(y)
        h = tf.nn.relu(_dense(h, v["ffn.fc1.weight"], v["ffn.fc1.bias"]))
        out = tf.linalg.matmul(h, v["ffn.fc2.weight"], transpose_b=True)
        return x + tf.cast(g(out), x.dtype) + v["ffn.fc2.bias"]


def build_model(
    model_cfg: dict, inp: zoo.InputSpec, seed: int, bf16: bool = False, groups=None, lazy=False
):
    """A zoo model with the canonical initial weights, or the user's Keras model.
    `groups`: the tensor axis and expert group from the process grid (none: one rank).
    `lazy` (ZeRO-3): a zoo model without its dense parameters, whose values the caller
    takes from `init_stream` a unit at a time, and zero buffers, filled the same way."""
    name = model_cfg["name"]
    if zoo.is_zoo_model(name) and lazy:
        groups = groups or ModelGroups()
        mine = local_layers(zoo.build_layers(model_cfg, inp), seed, groups.experts)
        layers = tensor_parallel.local_layers(mine, groups.tensor.size)
        names = (f"{s.name}.{p}" for s in layers for p in s.params)
        dense = {n for n in names if not is_expert_param(n)}
        return ZooNet(layers, {}, bf16, groups, sharded=dense)
    if zoo.is_zoo_model(name):
        groups = groups or ModelGroups()
        layers = zoo.build_layers(model_cfg, inp)
        # Initial values of all experts, then only this rank's experts (MoE) and this
        # rank's piece of each tensor-parallel layer.
        tp = groups.tensor
        weights = {
            k: tensor_parallel.shard(k, v, tp.size, tp.rank)
            for k, v in zoo.iter_init_weights(layers, seed)
        }
        mine = local_layers(layers, seed, groups.experts)
        return ZooNet(tensor_parallel.local_layers(mine, tp.size), weights, bf16, groups)
    from .tensorflow_user import build_user_model  # import, call, one checked forward pass

    if not bf16:
        return build_user_model(model_cfg, inp, seed)
    import keras

    # Keras's own mixed precision: layers made now compute in bfloat16 on float32
    # variables. The policy is process-wide, so it is put back after the build.
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        return build_user_model(model_cfg, inp, seed)
    finally:
        keras.mixed_precision.set_global_policy(before)
