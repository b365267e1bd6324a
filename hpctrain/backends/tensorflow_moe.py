"""The TensorFlow half of the MoE layer: gate, gather/scatter, custom gradient for the all-to-all.

Same math as torch_moe.py on raw tf ops. The backend runs the model inside a
tf.function, so the framework-neutral routing and the MPI exchanges run as
`tf.numpy_function`s: they are stateful ops, which tf.function executes in program
order, so every rank issues its all-to-alls (forward, then the backward ones that
`tf.custom_gradient` adds) in the same order. Expert variables stay out of Horovod's
grouped allreduce and their gradients are divided by the number of ranks.
"""

from __future__ import annotations

import time
import weakref

import numpy as np

from . import tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..moe.parallel import MoELayer, is_expert_param, require_group, step_metrics

# net -> {layer name: MoELayer}; net -> {layer name: aux loss of the latest call}
_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_aux: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _runtime(net, spec) -> MoELayer:
    per_net = _layers.setdefault(net, {})
    if spec.name not in per_net:
        per_net[spec.name] = MoELayer(spec.attrs["moe"], net.groups.experts, spec.name)
    return per_net[spec.name]


def _all_to_all(moe: MoELayer, x, send_rows, recv_rows, record: bool):
    """Alltoallv of rows whose gradient is the reverse Alltoallv."""

    def run(a, s, r):
        return moe.exchange(a, s, r, record)

    @tf.custom_gradient
    def exchange(x):
        y = tf.numpy_function(run, [x, send_rows, recv_rows], tf.float32)
        y.set_shape([None, x.shape[-1]])

        def grad(dy):
            dy = tf.convert_to_tensor(dy)  # a gather's gradient arrives as IndexedSlices
            g = tf.numpy_function(run, [dy, recv_rows, send_rows], tf.float32)
            g.set_shape(x.shape)
            return g

        return y, grad

    return exchange(x)


def _timed(moe: MoELayer, start: bool):
    """A numpy_function marking the expert compute's start or end (training calls only)."""

    def mark(*_):
        now = time.perf_counter()
        if start:
            moe._t_expert = now
        else:
            moe.stats.expert_s += now - getattr(moe, "_t_expert", now)
        return np.float32(0)

    return mark


def moe_ffn(net, spec, v, h, training: bool, router=None):
    """The MoE feed-forward of a transformer block: h [n, t, d] -> [n, t, d]. `router`:
    the router weight as the caller passes it on (tensor parallelism: through `f`)."""
    moe = _runtime(net, spec)
    router = v["moe.router.weight"] if router is None else router
    record = training is True  # per traced graph: training calls counted, not recomputes
    opts = moe.opts
    d = h.shape[-1]
    x = tf.reshape(h, [-1, d])
    xr = x
    if training and opts["jitter"] > 0:  # a recompute (not True) takes its forward's noise
        draw = moe.jitter_noise if training is True else moe.repeat_jitter_noise
        noise = tf.numpy_function(draw, [tf.shape(x)], tf.float32)
        xr = x * tf.reshape(noise, tf.shape(x))
    probs = tf.nn.softmax(tf.linalg.matmul(xr, router, transpose_b=True), -1)
    out_types = [tf.int64] * 8 + [tf.float32]
    plan = tf.numpy_function(
        lambda p: moe.plan(p, record).arrays(), [tf.stop_gradient(probs)], out_types
    )
    experts, token, slot, send_rows, recv_rows, perm, inv_perm, expert_rows, frac = plan
    experts.set_shape([None, moe.k])
    for t in (token, slot, perm, inv_perm):
        t.set_shape([None])
    for t, n in ((send_rows, moe.group.size), (recv_rows, moe.group.size)):
        t.set_shape([n])
    expert_rows.set_shape([moe.per_rank])
    frac.set_shape([moe.E])
    top = tf.gather(probs, experts, batch_dims=1)
    gates = top if moe.k == 1 else top / tf.reduce_sum(top, axis=-1, keepdims=True)
    recv = _all_to_all(moe, tf.gather(x, token), send_rows, recv_rows, record)
    if record:
        with tf.control_dependencies([tf.numpy_function(_timed(moe, True), [recv], tf.float32)]):
            recv = tf.identity(recv)
    grouped = tf.gather(recv, perm)
    outs = []
    for j, rows in enumerate(tf.split(grouped, expert_rows, num=moe.per_rank)):
        e = f"moe.experts.{moe.first + j}"
        hidden = tf.nn.relu(
            tf.linalg.matmul(rows, v[f"{e}.fc1.weight"], transpose_b=True) + v[f"{e}.fc1.bias"]
        )
        outs.append(
            tf.linalg.matmul(hidden, v[f"{e}.fc2.weight"], transpose_b=True) + v[f"{e}.fc2.bias"]
        )
    out = tf.gather(tf.concat(outs, 0), inv_perm)
    if record:
        with tf.control_dependencies([tf.numpy_function(_timed(moe, False), [out], tf.float32)]):
            out = tf.identity(out)
    back = _all_to_all(moe, out, recv_rows, send_rows, record)
    coef = tf.gather_nd(gates, tf.stack([token, slot], axis=1))
    y = tf.math.unsorted_segment_sum(back * coef[:, None], token, tf.shape(x)[0])
    aux = opts["aux_loss"] * moe.E * tf.reduce_sum(frac * tf.reduce_mean(probs, axis=0))
    _aux.setdefault(net, {})[spec.name] = aux
    return tf.reshape(y, tf.shape(h))


def aux_loss(net, layer_names: list[str] | None = None):
    """Sum of the load-balancing losses of the net's latest call (None without MoE), per
    batch: with tensor parallelism each of a batch's T ranks routed 1/T of it.
    `layer_names`: those layers' only (ZeRO-3 runs a unit of layers at a time)."""
    latest = _aux.get(net, {})
    losses = [v for k, v in latest.items() if layer_names is None or k in layer_names]
    if not losses:
        return None
    return tf.add_n(losses) / float(require_group(net.groups.experts).ranks_per_batch)


def average_gradients(hvd, grads: list, names: list[str], compression, group) -> list:
    """Horovod average of the dense gradients; experts' gradients by `expert_grads`."""
    if hvd.size() == 1:
        return grads
    dense = [i for i, n in enumerate(names) if not is_expert_param(n)]
    if len(dense) == len(grads):
        return hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression)
    out = expert_grads(grads, names, group)
    if dense:
        avg = hvd.grouped_allreduce(
            [grads[i] for i in dense], op=hvd.Average, compression=compression
        )
        for i, g in zip(dense, avg, strict=True):
            out[i] = g
    return out


def expert_grads(grads: list, names: list[str], group) -> list:
    """Local experts' gradients: each sums its expert group's batches, so divided by
    their number (`grad_scale`), then averaged over the group's data-parallel replicas.
    Dense gradients are returned unchanged. `group`: the expert group."""
    idx = [i for i, n in enumerate(names) if is_expert_param(n)]
    out = list(grads)
    if not idx:
        return out
    group = require_group(group)
    flat = np.concatenate([np.asarray(grads[i]).reshape(-1) for i in idx]).astype(np.float32)
    flat *= np.float32(group.grad_scale)
    group.average_over_replicas(flat)
    at = 0
    for i in idx:
        n = int(np.prod(grads[i].shape))
        out[i] = tf.constant(flat[at : at + n].reshape(grads[i].shape))
        at += n
    return out


def clip_like_torch(grads: list, names: list[str], max_norm: float, group) -> list:
    """torch.nn.utils.clip_grad_norm_ on the global model (expert norms summed over ranks)."""
    sq_dense = sum(
        float(tf.reduce_sum(g * g)) for g, n in zip(grads, names) if not is_expert_param(n)
    )
    sq_expert = sum(float(tf.reduce_sum(g * g)) for g, n in zip(grads, names) if is_expert_param(n))
    if any(is_expert_param(n) for n in names):
        sq_expert = require_group(group).allreduce_sum(sq_expert)
    coef = min(max_norm / ((sq_dense + sq_expert) ** 0.5 + 1e-6), 1.0)
    return [g * coef for g in grads]


def has_experts(names) -> bool:
    return any(is_expert_param(n) for n in names)


def step_extra(net, step_seconds: float) -> dict:
    """This step's MoE metrics (empty without MoE); resets the counters."""
    layers = list(_layers.get(net, {}).values())
    return step_metrics(layers, step_seconds, layers[0].group.size) if layers else {}
