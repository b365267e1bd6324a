"""TensorFlow backend: zoo models on raw tf ops, gradients averaged by Horovod or MPI.

Horovod 0.28.1's DistributedGradientTape and Keras callbacks fail under Keras 3
(`'Variable' object has no attribute 'ref'`, horovod issue 4290), while its tensor
collectives work. So gradients come from a plain `tf.GradientTape` and are averaged
with one `hvd.grouped_allreduce` per step (Horovod fuses the group), variables are
plain `tf.Variable`s broadcast from rank 0, and the optimizers apply exactly torch's
update rules, so both backends produce the same numbers. The `mpi` engine (see
`gradient_engine`) sums one flat gradient buffer with `MPI_Allreduce` instead and never
starts Horovod.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict

import numpy as np

from . import tf_env, tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..exchange import make_reducer
from ..exchange.overlap import OverlapMean
from ..models import zoo
from ..moe.parallel import expert_group, is_expert_param, local_layers
from ..runtime.memory import peak_rss_bytes
from ..tensor import parallel as tensor_parallel
from . import gradient_engine, tensorflow_moe, tensorflow_user
from .base import (
    OPTIMIZER_SLOTS,
    BackendBase,
    EvalStats,
    StepStats,
    build_agreed,
    model_part,
    replicated_memory_plan,
    split_square_sums,
    with_model_prefix,
)
from .tensorflow_zero import TensorFlowZero

tf_env.quiet_python_loggers()

# Elementwise intermediates of one variable's optimizer update alive at once, at most
# (Adam: b1*m, (1-b1)*g, g*g, b2*v, ... scheduled together by TF's executor).
UPDATE_TEMPORARIES = 4


def probe() -> dict:
    """Versions and Horovod build facts, for `hpctrain doctor`."""
    import horovod
    import horovod.tensorflow as hvd
    import keras

    built = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built()}
    missing = [k for k in ("MPI", "Gloo") if not built[k]]
    ops = ", ".join(k for k, v in built.items() if v) or "none"
    gpus = len(tf.config.list_physical_devices("GPU"))
    return {
        "framework": f"{tf.__version__} (Keras {keras.__version__}, GPUs {gpus})",
        "horovod": f"{horovod.__version__}; controllers/ops: {ops}",
        "missing": missing,
    }


def configure_threads(threads: int, deterministic: bool) -> None:
    """Must run before TF executes its first op; later calls are ignored by TF."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1 if threads <= 2 else 2)
    except RuntimeError:
        pass  # the runtime is already up (a second backend in one process)
    if deterministic:
        tf.config.experimental.enable_op_determinism()


def prepare_process(threads: int, deterministic: bool, seed: int) -> None:
    """Threads, deterministic kernels and every random stream of this rank's process."""
    configure_threads(threads, deterministic)
    tf.random.set_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def eval_sums(net, x, y):
    """Summed loss and correct predictions of one batch (traced by tf.function)."""
    logits = tf.cast(net(x, training=False), tf.float32)  # bf16 models: loss in float32
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.int64))
    return tf.reduce_sum(losses), correct


def evaluate_with(eval_fn, x, y) -> EvalStats:
    loss, correct = eval_fn(tf.constant(x), tf.constant(y))
    return EvalStats(float(loss), int(correct), int(np.prod(y.shape)))


def _keras_global_seed_generator(create: bool = False):
    """Keras's process-wide SeedGenerator (keras.random.* with seed=None): the one in
    use, or (create=True) the one a later trace will use, made now to take a state."""
    try:
        from keras.src.backend.common import global_state
        from keras.src.random.seed_generator import global_seed_generator
    except ImportError:  # pragma: no cover - another Keras layout
        return None
    if create:
        return global_seed_generator()
    return global_state.get_global_attribute("global_seed_generator")


def _seed_key(variable_key: str) -> str:
    return "keras.seed." + variable_key.replace("/", ":")  # checkpoint keys have no '/'


def _tf_global_generator():
    """TF's global tf.random.Generator if one exists (never creates one: under op
    determinism creating it is an error, and a fresh one would be seeded at random)."""
    from tensorflow.python.ops import stateful_random_ops

    return getattr(stateful_random_ops, "global_generator", None)


def rng_state() -> dict[str, np.ndarray]:
    """Every TF/Keras random stream random layers draw from, as arrays.

    The zoo draws nothing inside TF (weights come from numpy); user Keras models do:
    each layer's SeedGenerator (Dropout, GaussianNoise, ...; registered by
    tensorflow_user), Keras's global seed generator (keras.random.* with seed=None) and
    TF's global tf.random.Generator. Stateless op seeds need nothing; the hidden
    counters of stateful ops (tf.random.normal without a generator) cannot be read.
    """
    out = {_seed_key(k): v.numpy().copy() for k, v in tensorflow_user.seed_states().items()}
    keras_global = _keras_global_seed_generator()
    if keras_global is not None:
        out["keras.global_seed"] = keras_global.state.numpy().copy()
    tf_global = _tf_global_generator()
    if tf_global is not None:
        out["tf.global_generator"] = tf_global.state.numpy().copy()
    return out


def set_rng_state(state: dict[str, np.ndarray]) -> None:
    """Put back what `rng_state` took, into the same variables (traced functions hold
    them), so dropout masks and noise continue exactly where the checkpoint stopped."""
    for k, var in tensorflow_user.seed_states().items():
        if _seed_key(k) in state:
            var.assign(np.asarray(state[_seed_key(k)], dtype=var.dtype))
    keras_global = _keras_global_seed_generator(create="keras.global_seed" in state)
    if keras_global is not None and "keras.global_seed" in state:
        keras_global.state.assign(
            np.asarray(state["keras.global_seed"], dtype=keras_global.state.dtype)
        )
    tf_global = _tf_global_generator()
    if tf_global is not None and "tf.global_generator" in state:
        tf_global.reset(np.asarray(state["tf.global_generator"], dtype=np.int64))


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
    return tf.linalg.matmul(x, w, transpose_b=True) + b


def _tensor_allreduce(x, what: str):
    """Sum over the tensor axis inside a traced function (a stateful numpy_function:
    tf.function keeps stateful ops in program order, so every rank issues the
    collectives in the same order)."""
    group = tensor_parallel.tensor_group()
    y = tf.numpy_function(
        lambda a: group.allreduce_sum(a, what), [tf.cast(x, tf.float32)], tf.float32
    )
    y.set_shape(x.shape)
    return tf.cast(y, x.dtype)


@tf.custom_gradient
def _copy_to_tensor_axis(x):
    """Megatron's f: identity forward, allreduce of the gradient backward."""
    return tf.identity(x), lambda dy: _tensor_allreduce(dy, "input gradient (f)")


@tf.custom_gradient
def _reduce_from_tensor_axis(x):
    """Megatron's g: allreduce forward, identity backward."""
    return _tensor_allreduce(x, "partial output (g)"), lambda dy: tf.identity(dy)


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
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) / tf.sqrt(var + zoo.LN_EPS) * w + b


class ZooNet(tf.Module):
    """A zoo model: canonical-name variables and a forward pass equal to torch's."""

    def __init__(self, layers: list[zoo.LayerSpec], weights: dict[str, np.ndarray], bf16=False):
        super().__init__(name="zoo")
        self.layers = layers
        # bf16: the forward pass computes in bfloat16 on casts of the float32 variables
        # (their gradients come back float32); BatchNorm statistics stay float32.
        self.compute_dtype = tf.bfloat16 if bf16 else tf.float32
        self.vars: OrderedDict[str, tf.Variable] = OrderedDict()
        self.buffers: OrderedDict[str, tf.Variable] = OrderedDict()
        for spec in layers:
            for p in spec.params:
                key = f"{spec.name}.{p}"
                self.vars[key] = tf.Variable(weights[key], name=key.replace(".", "/"))
            for bname in spec.buffers:
                key = f"{spec.name}.{bname}"
                self.buffers[key] = tf.Variable(
                    weights[key], trainable=False, name=key.replace(".", "/")
                )

    def _bn(self, x, prefix, training):
        if x.dtype != tf.float32:
            return tf.cast(self._bn(tf.cast(x, tf.float32), prefix, training), x.dtype)
        w, b = self.vars[f"{prefix}.weight"], self.vars[f"{prefix}.bias"]
        rm, rv = self.buffers[f"{prefix}.running_mean"], self.buffers[f"{prefix}.running_var"]
        if not training:
            return (x - rm) / tf.sqrt(rv + zoo.BN_EPS) * w + b
        mean, var = tf.nn.moments(x, axes=[0, 1, 2])
        n = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), x.dtype)
        m = zoo.BN_MOMENTUM
        rm.assign((1 - m) * rm + m * mean)
        rv.assign((1 - m) * rv + m * var * n / (n - 1))  # torch keeps the unbiased variance
        return (x - mean) / tf.sqrt(var + zoo.BN_EPS) * w + b

    def __call__(self, x, training=False):
        nchw = len(x.shape) == 4  # images arrive NCHW (canonical); TF convolves NHWC
        low = self.compute_dtype != tf.float32
        if low and x.dtype.is_floating:
            x = tf.cast(x, self.compute_dtype)
        for spec in self.layers:
            v = {p: self.vars[f"{spec.name}.{p}"] for p in spec.params}
            if low:
                v = {p: tf.cast(w, self.compute_dtype) for p, w in v.items()}
            kind, a = spec.kind, spec.attrs
            if kind in ("conv", "conv_bn", "resblock", "gap") and nchw:
                x, nchw = tf.transpose(x, [0, 2, 3, 1]), False
            if kind == "flatten":
                x = tf.reshape(x, [tf.shape(x)[0], -1])
            elif kind == "dense":
                x = _dense(x, v["weight"], v["bias"])
                x = tf.nn.relu(x) if a["relu"] else x
            elif kind == "conv":
                x = _conv(x, v["weight"], v.get("bias"), a["stride"], a["padding"])
                x = tf.nn.relu(x) if a["relu"] else x
            elif kind == "gap":
                x = tf.reduce_mean(x, axis=[1, 2])
            elif kind == "conv_bn":
                x = tf.nn.relu(
                    self._bn(
                        _conv(x, v["conv.weight"], None, a["stride"], 1),
                        f"{spec.name}.bn",
                        training,
                    )
                )
            elif kind == "resblock":
                x = self._resblock(x, spec, v, training)
            elif kind == "embed":
                x = tf.gather(v["tok.weight"], x) + v["pos.weight"][: tf.shape(x)[1]]
            elif kind == "layernorm":
                x = _layer_norm(x, v["weight"], v["bias"])
            elif kind == "block" and a.get("recompute") and training:
                x = self._recomputed_block(x, v, a["n_heads"], spec)
            elif kind == "block":
                x = self._block(x, v, a["n_heads"], spec, training)
            else:
                raise ValueError(f"unknown layer kind {kind!r}")
        return tf.cast(x, tf.float32) if low else x

    def _resblock(self, x, spec, v, training):
        s, n = spec.attrs["stride"], spec.name
        out = tf.nn.relu(self._bn(_conv(x, v["conv1.weight"], None, s, 1), f"{n}.bn1", training))
        out = self._bn(_conv(out, v["conv2.weight"], None, 1, 1), f"{n}.bn2", training)
        if "shortcut.conv.weight" in v:
            x = self._bn(
                _conv(x, v["shortcut.conv.weight"], None, s, 0), f"{n}.shortcut.bn", training
            )
        return tf.nn.relu(out + x)

    def _recomputed_block(self, x, v, heads, spec):
        """Activation checkpointing: only the block's input is kept for backward; the
        block runs again inside the gradient (tf.recompute_grad), giving exact gradients."""
        return tf.recompute_grad(lambda t: self._block(t, v, heads, spec, True))(x)

    def _block(self, x, v, heads, spec=None, training=False):
        if spec is not None and spec.attrs.get("tensor", 1) > 1:
            return self._tensor_parallel_block(x, v, heads, spec, training)
        shape = tf.shape(x)
        n, t = shape[0], shape[1]
        h = _layer_norm(x, v["ln1.weight"], v["ln1.bias"])
        y = _causal_attention(_dense(h, v["attn.qkv.weight"], v["attn.qkv.bias"]), n, t, heads)
        x = x + _dense(y, v["attn.proj.weight"], v["attn.proj.bias"])
        h = _layer_norm(x, v["ln2.weight"], v["ln2.bias"])
        if spec is not None and "moe" in spec.attrs:  # mixture of experts: tensorflow_moe.py
            return x + tensorflow_moe.moe_ffn(self, spec, v, h, training)
        h = _dense(
            tf.nn.relu(_dense(h, v["ffn.fc1.weight"], v["ffn.fc1.bias"])),
            v["ffn.fc2.weight"],
            v["ffn.fc2.bias"],
        )
        return x + h

    def _tensor_parallel_block(self, x, v, heads, spec, training):
        """The block with this rank's heads and MLP slice (Megatron): f before the
        column-parallel layers, g after the row-parallel ones, biases after g; with
        experts, this rank's samples through them (tensor/parallel.py)."""
        shape = tf.shape(x)
        n, t = shape[0], shape[1]
        h = _copy_to_tensor_axis(_layer_norm(x, v["ln1.weight"], v["ln1.bias"]))
        y = _causal_attention(_dense(h, v["attn.qkv.weight"], v["attn.qkv.bias"]), n, t, heads)
        out = tf.linalg.matmul(y, v["attn.proj.weight"], transpose_b=True)
        x = x + _reduce_from_tensor_axis(out) + v["attn.proj.bias"]
        h = _copy_to_tensor_axis(_layer_norm(x, v["ln2.weight"], v["ln2.bias"]))
        if spec is not None and "moe" in spec.attrs:  # this rank's samples, to the experts
            lo, hi = tensor_parallel.tensor_group().my_rows(n)
            router = _copy_to_tensor_axis(v["moe.router.weight"])
            y = tensorflow_moe.moe_ffn(self, spec, v, h[lo:hi], training, router)
            y = tf.pad(y, [[lo, n - hi], [0, 0], [0, 0]])  # the other ranks' rows: 0
            return x + _reduce_from_tensor_axis(y)
        h = tf.nn.relu(_dense(h, v["ffn.fc1.weight"], v["ffn.fc1.bias"]))
        out = tf.linalg.matmul(h, v["ffn.fc2.weight"], transpose_b=True)
        return x + _reduce_from_tensor_axis(out) + v["ffn.fc2.bias"]


def build_model(model_cfg: dict, inp: zoo.InputSpec, seed: int, bf16: bool = False):
    name = model_cfg["name"]
    if zoo.is_zoo_model(name):
        layers = zoo.build_layers(model_cfg, inp)
        # Initial values of all experts, then only this rank's experts (MoE) and this
        # rank's piece of each tensor-parallel layer.
        tp = tensor_parallel.tensor_group()
        weights = {
            k: tensor_parallel.shard(k, v, tp.size, tp.rank)
            for k, v in zoo.iter_init_weights(layers, seed)
        }
        local = tensor_parallel.local_layers(local_layers(layers, seed), tp.size)
        return ZooNet(local, weights, bf16)
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


# --- torch's optimizer update rules in tf ops -------------------------------------------
class _Optimizer:
    def __init__(self, ocfg: dict, variables: OrderedDict):
        self.kind = ocfg["name"]
        self.momentum = float(ocfg["momentum"])
        self.wd = float(ocfg["weight_decay"])
        self.b1, self.b2 = (float(b) for b in ocfg["betas"])
        self.eps = float(ocfg["eps"])
        self.variables = variables
        self.slots = {
            slot: OrderedDict(
                (k, tf.Variable(tf.zeros_like(v), trainable=False)) for k, v in variables.items()
            )
            for slot in OPTIMIZER_SLOTS[self.kind]
        }
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.started = tf.Variable(False, trainable=False)  # SGD buffers start at g

    @tf.function(reduce_retracing=True)
    def apply(self, grads, lr):
        """One update of every variable, one variable after the other: TF's executor
        would otherwise start every variable's elementwise ops at once and hold all their
        temporaries together (measured: 2x the model for Adam on the 48M transformer of
        tests/test_memory_limit_jobs.py), where in turn it holds one variable's
        (`workspace_bytes`). The same ops in the same order per variable: same numbers."""
        self.step.assign_add(1)
        vars_ = list(self.variables.values())
        done = []  # the previous variable's last update: the next one waits for it
        if self.kind == "sgd":
            bufs = list(self.slots["momentum_buffer"].values())
            for var, g, buf in zip(vars_, grads, bufs, strict=True):
                with tf.control_dependencies(done):
                    if self.wd:
                        g = g + self.wd * var
                    if self.momentum:
                        buf.assign(
                            tf.cond(
                                self.started,
                                lambda b=buf, g=g: self.momentum * b + g,
                                lambda g=g: g,
                            )
                        )
                        g = buf
                    done = [var.assign_sub(lr * g)]
            with tf.control_dependencies(done):
                self.started.assign(True)
        else:
            t = tf.cast(self.step, tf.float32)
            bc1 = 1.0 - tf.pow(self.b1, t)
            bc2 = 1.0 - tf.pow(self.b2, t)
            ms, vs = self.slots["exp_avg"].values(), self.slots["exp_avg_sq"].values()
            for var, g, m, v in zip(vars_, grads, ms, vs, strict=True):
                with tf.control_dependencies(done):
                    if self.wd:
                        g = g + self.wd * var
                    m.assign(self.b1 * m + (1 - self.b1) * g)
                    v.assign(self.b2 * v + (1 - self.b2) * g * g)
                    denom = tf.sqrt(v) / tf.sqrt(bc2) + self.eps
                    done = [var.assign_sub((lr / bc1) * m / denom)]

    def workspace_bytes(self) -> int:
        """Temporaries one `apply` holds at once: the elementwise intermediates of the
        largest variable's update (measured: 3.3x a 48 MiB ZeRO shard for Adam)."""
        largest = max((int(np.prod(v.shape)) * 4 for v in self.variables.values()), default=0)
        return UPDATE_TEMPORARIES * largest

    def export_state(self) -> dict[str, np.ndarray]:
        """Slots in torch's canonical layout (`optimizer/<slot>/<name>`, `optimizer/step`)."""
        state = {}
        started = bool(self.started.numpy()) or self.kind != "sgd"
        for slot, values in self.slots.items():
            for k, v in values.items():
                # torch has no momentum buffer before the first step: export zeros then too
                state[f"optimizer/{slot}/{k}"] = (
                    v.numpy().copy() if started else np.zeros(v.shape, np.float32)
                )
        if self.kind == "adam":
            state["optimizer/step"] = np.array(int(self.step.numpy()), dtype=np.int64)
        return state

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        """The inverse of `export_state` (ValueError naming a missing slot)."""
        for slot, values in self.slots.items():
            for k, v in values.items():
                key = f"optimizer/{slot}/{k}"
                if key not in state:
                    raise ValueError(f"optimizer state {key} missing")
                v.assign(np.asarray(state[key], dtype=np.float32))
        self.step.assign(int(state.get("optimizer/step", 0)))
        # A restored SGD buffer (even all-zero after a step) continues as momentum.
        self.started.assign(
            self.kind == "sgd"
            and any(np.any(state[f"optimizer/momentum_buffer/{k}"]) for k in self.variables)
        )


def _clip_like_torch(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when above it."""
    norm = tf.sqrt(tf.add_n([tf.reduce_sum(g * g) for g in grads]))
    coef = tf.minimum(max_norm / (norm + 1e-6), 1.0)
    return [g * coef for g in grads]


def _clip_tensor_parallel(grads, names, max_norm):
    """torch's rule on the whole model: squares of split variables summed over the
    tensor axis, those of experts over their group (each expert lives on one of its
    ranks), replicated ones counted once."""

    def squares():
        return [float(tf.reduce_sum(tf.cast(g, tf.float64) ** 2)) for g in grads]

    split, whole = split_square_sums(names, squares, tensor_parallel.split_kind)
    split = float(tensor_parallel.tensor_group().allreduce_sum(np.array([split]), "norm")[0])
    coef = max_norm / ((whole + split) ** 0.5 + 1e-6)
    return [g * coef for g in grads] if coef < 1.0 else grads


class TensorFlowBackend(BackendBase):
    name = "tensorflow"

    def __init__(self, cfg, world, inp: zoo.InputSpec, threads: int, hvd_comm=None):
        self.cfg = cfg
        self.world = world
        local = getattr(world, "local_size", 1)  # a grid axis has no node layout
        self.engine, self.engine_reason = gradient_engine.choose(cfg, local, threads, world=world)
        self.inp = inp
        seed = cfg.train["seed"]
        rank = world.rank if world is not None else 0
        prepare_process(threads, cfg.train["deterministic"], seed + rank)
        self.hvd = self.compression = None
        if self.engine == "horovod":
            import horovod.tensorflow as hvd

            if not hvd.is_initialized():
                hvd.init(comm=hvd_comm if hvd_comm is not None else world.comm)
            self.hvd = hvd
            fp16 = cfg.train["compression"] == "fp16"
            self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        bf16 = cfg.train["precision"] == "bf16"
        self.net = build_agreed(world, lambda: build_model(cfg.model, inp, seed, bf16))
        self.clip = cfg.train["clip_norm"]
        self._dense = [n for n in self.net.vars if not is_expert_param(n)]
        self.zero = None  # ZeRO-1/2: the optimizer holds this rank's shard only
        if cfg.train["zero"]:
            self.zero = TensorFlowZero(
                world,
                [self.net.vars[n] for n in self._dense],
                cfg.train["zero"],
                int(cfg.train["bucket_mb"] * 2**20),
                lambda variables: _Optimizer(cfg.optimizer, variables),
            )
            self.optimizer = self.zero.optimizer
            self._flat = self.zero.part
            experts = OrderedDict((n, v) for n, v in self.net.vars.items() if is_expert_param(n))
            # MoE experts are local to a rank: their own optimizer, beside the shard's
            self.expert_optimizer = _Optimizer(cfg.optimizer, experts) if experts else None
        else:
            self.optimizer = _Optimizer(cfg.optimizer, self.net.vars)
            self._flat = make_reducer(
                cfg, world, [tuple(self.net.vars[n].shape) for n in self._dense], engine=self.engine
            )
        if self.engine == "overlap":
            # TF computes every gradient in one tape.gradient call: nothing is final
            # before it returns, so the buckets travel after it (pipelined with each
            # other, not with backward).
            self._flat = OverlapMean(world, self._flat.sizes, int(cfg.train["bucket_mb"] * 2**20))
            self.engine_reason += "; TensorFlow sends the buckets after tape.gradient"
        self.exchange_step = 0  # optimizer steps taken (reducers' warm-up, local SGD)
        self.broadcast_from_root()
        self._grad_fn = tf.function(self._grads, reduce_retracing=True)
        self._eval_fn = tf.function(lambda x, y: eval_sums(self.net, x, y), reduce_retracing=True)

    def broadcast_from_root(self) -> None:
        """Every replica takes rank 0's variables and optimizer state.

        Horovod's broadcast_variables runs in a tf.function that fails on Keras 3
        variables ('SymbolicTensor' object has no attribute 'assign'), so each variable is
        broadcast eagerly and assigned here; this works for tf.Variable and Keras alike.
        """
        if self._size() == 1:
            return
        opt = self.optimizer
        if self.zero is not None:  # each rank's optimizer state is its own shard
            dense = [v for k, v in self.net.vars.items() if not is_expert_param(k)]
            for i, var in enumerate([*dense, *self.net.buffers.values()]):
                var.assign(self.world.bcast_inplace(np.array(var.numpy()), what=f"broadcast {i}"))
            self.zero.sync_shard()
            return
        everything = [  # MoE experts differ per rank: never broadcast
            *(v for k, v in self.net.vars.items() if not is_expert_param(k)),
            *self.net.buffers.values(),
            *(v for slot in opt.slots.values() for k, v in slot.items() if not is_expert_param(k)),
            opt.step,
            opt.started,
        ]
        for i, var in enumerate(everything):
            if self.hvd is None:
                value = np.array(var.numpy())  # 0-d stays 0-d (ascontiguousarray: 1-d)
                var.assign(self.world.bcast_inplace(value, what=f"broadcast variable {i}"))
                continue
            var.assign(
                self.hvd.broadcast(
                    tf.convert_to_tensor(var), root_rank=0, name=f"hpctrain.bcast.{i}"
                )
            )

    def _size(self) -> int:
        return self.world.size if self.world is not None else 1

    # --- training ---------------------------------------------------------------
    def _grads(self, x, y, scale):
        with tf.GradientTape() as tape:
            logits = tf.cast(self.net(x, training=True), tf.float32)  # bf16: loss in f32
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            loss_sum = tf.reduce_sum(losses)
            scaled = loss_sum * scale
            aux = tensorflow_moe.aux_loss(self.net)  # MoE load balancing, weighted per token
            if aux is not None:
                scaled += aux * tf.cast(tf.size(y), tf.float32) * scale
        grads = tape.gradient(scaled, list(self.net.vars.values()))
        grads = [tf.convert_to_tensor(g) for g in grads]  # embeddings give IndexedSlices
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.int64))
        return loss_sum, correct, grads

    def train_step(self, micro_batches, lr: float) -> StepStats:
        if self.zero is not None:
            return self._zero_step(micro_batches, lr)
        t_step = time.perf_counter()
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        scale = tf.constant(1.0 / total, tf.float32)
        acc, loss_sum, correct = None, 0.0, 0
        for x, y in micro_batches:
            loss, corr, grads = self._grad_fn(tf.constant(x), tf.constant(y), scale)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
            grads = None  # only `acc` holds the gradients (the MPI engine frees them)
            loss_sum += float(loss)
            correct += int(corr)
        t0 = time.perf_counter()
        names = list(self.net.vars)  # MoE experts: local, divided by ranks, not allreduced
        if self.hvd is None:
            acc = self._average_with_mpi(acc, names)
        else:
            acc = tensorflow_moe.average_gradients(self.hvd, acc, names, self.compression)
        comm = time.perf_counter() - t0
        if self.clip is not None and tensor_parallel.tensor_group().size > 1:
            acc = _clip_tensor_parallel(acc, names, float(self.clip))
        elif self.clip is not None and tensorflow_moe.has_experts(names):
            acc = tensorflow_moe.clip_like_torch(acc, names, float(self.clip))
        elif self.clip is not None:
            acc = _clip_like_torch(acc, float(self.clip))
        self.optimizer.apply(acc, tf.constant(lr, tf.float32))
        extra = tensorflow_moe.step_extra(self.net, time.perf_counter() - t_step)
        if self.hvd is None:
            extra.update(self._flat.stats())
        extra.update(self.memory(acc))
        return StepStats(loss_sum, correct, total, comm, extra)

    def _zero_step(self, micro_batches, lr: float) -> StepStats:
        """ZeRO-1/2: reduce-scatter, clip by the global norm, update the shard, allgather.
        Stage 2 reduces after every micro-batch (accumulation keeps only the shard)."""
        z = self.zero
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        scale = tf.constant(1.0 / total, tf.float32)
        z.begin_step()
        acc, loss_sum, correct, comm = None, 0.0, 0, 0.0
        names = list(self.net.vars)
        dense = [names.index(n) for n in self._dense]
        local = [i for i, n in enumerate(names) if is_expert_param(n)]  # MoE experts
        experts = None
        for x, y in micro_batches:
            loss, corr, grads = self._grad_fn(tf.constant(x), tf.constant(y), scale)
            if local:
                mine = [grads[i] for i in local]
                experts = mine if experts is None else [a + g for a, g in zip(experts, mine)]
            grads = [grads[i] for i in dense]
            loss_sum += float(loss)
            correct += int(corr)
            if z.part.stage == 2:
                t0 = time.perf_counter()
                z.reduce(grads)
                comm += time.perf_counter() - t0
            else:
                acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
        t0 = time.perf_counter()
        if acc is not None:
            z.reduce(acc)
        if experts is not None:  # scaled to the batches' mean, averaged over copies
            experts = tensorflow_moe.expert_grads(experts, [names[i] for i in local])
        if self.clip is not None:
            extra_sq = 0.0
            if experts is not None:  # each expert lives on one rank of its group
                sq = sum(float(tf.reduce_sum(tf.cast(g, tf.float64) ** 2)) for g in experts)
                extra_sq = expert_group().allreduce_sum(sq)
            coef = z.clip(float(self.clip), self._tensor_split_mask(), extra_sq)
            if experts is not None and coef < 1.0:
                experts = [g * coef for g in experts]
        z.step(lr)
        if experts is not None:
            self.expert_optimizer.apply(experts, tf.constant(lr, tf.float32))
        comm += time.perf_counter() - t0  # includes the shard's update
        self.exchange_step += 1
        extra = {"comm_bytes": float(z.part.take_sent()), "compression_ratio": 1.0}
        extra.update(self.memory())
        return StepStats(loss_sum, correct, total, comm, extra)

    def _tensor_split_mask(self):
        """(shard mask of tensor-split variables, tensor group), or None without TP."""
        group = tensor_parallel.tensor_group()
        if group.size == 1:
            return None
        if not hasattr(self, "_split_mask"):
            split = {
                i for i, n in enumerate(self._dense) if tensor_parallel.split_kind(n) is not None
            }
            self._split_mask = self.zero.part.shard_mask(split)
        return self._split_mask, group

    def memory_plan(self) -> dict[str, float]:
        """Bytes of gradients and optimizer state this rank will hold once training runs
        (`grad`, `optimizer`) and how much of them is resident now (`*_now`: the slots
        exist from the start; gradients come from the tape, numpy buffers fill at use).
        The optimizer's figure includes the temporaries of its update (one variable's
        at a time, see _Optimizer.apply), which come on top of the slots."""
        slots = len(OPTIMIZER_SLOTS[self.optimizer.kind])
        opt_now = self.memory()["mem_optimizer_bytes"]
        workspace = float(self.optimizer.workspace_bytes())
        if self.zero is not None:
            e = self.zero.part.expected_bytes(slots)
            return {
                # the tape returns every local gradient at once, then they are reduced;
                # the step hands the shard's gradient to TF as a copy (tf.constant)
                "grad": e["zero_model_param_bytes"]
                + 2 * e["zero_model_grad_bytes"]
                + self.zero.part.largest_segment_bytes(),
                "grad_now": 0.0,
                "optimizer": e["zero_model_optimizer_bytes"] + workspace,
                "optimizer_now": opt_now,
            }
        trainable = sum(int(np.prod(v.shape)) * 4 for v in self.net.vars.values())
        plan = replicated_memory_plan(trainable, self._flat, slots, opt_now)
        plan["optimizer"] += workspace
        return plan

    def memory(self, grads=None) -> dict[str, float]:
        """Per-rank bytes of parameters, gradients and optimizer state, and peak RSS."""
        slots = len(OPTIMIZER_SLOTS[self.optimizer.kind])
        if self.zero is not None:
            out = self.zero.memory(slots)
        else:
            buffer = getattr(self._flat, "buffer", None)
            held = sum(int(np.prod(g.shape)) * 4 for g in grads or [])
            out = {
                "mem_param_bytes": float(
                    sum(int(np.prod(v.shape)) * 4 for v in self.net.vars.values())
                ),
                "mem_grad_bytes": float(held + (buffer.nbytes if buffer is not None else 0)),
                "mem_optimizer_bytes": float(
                    sum(
                        int(np.prod(v.shape)) * 4
                        for values in self.optimizer.slots.values()
                        for v in values.values()
                    )
                ),
            }
        out["mem_peak_rss_bytes"] = float(peak_rss_bytes())
        return out

    def _average_with_mpi(self, grads: list, names: list[str]) -> list:
        """One MPI_Allreduce of every dense gradient (the `mpi` engine); experts / ranks.
        Takes the gradients out of `grads` (the caller's list) as they are copied."""
        size = self._size()
        if size == 1:
            return grads
        experts = tensorflow_moe.expert_grads(grads, names)  # dense: the same tensors
        shapes = [tuple(g.shape) for g in grads]
        at = {n: i for i, n in enumerate(names)}
        for name, view in zip(self._dense, self._flat.views, strict=True):
            i = at[name]
            view[:] = grads[i].numpy().reshape(-1)
            # The buffer holds it now: drop the tape's tensor (`grads` is the caller's
            # list), so the reduced copies below replace the gradients instead of
            # coming on top of them (memory_plan counts one gradient and the buffer).
            grads[i] = experts[i] = None
        self._flat.reduce(self.exchange_step)
        self.exchange_step += 1
        dense = dict(zip(self._dense, self._flat.views, strict=True))
        return [
            tf.constant(dense[n].reshape(shape)) if n in dense else e
            for n, shape, e in zip(names, shapes, experts, strict=True)
        ]

    def evaluate(self, x, y) -> EvalStats:
        return evaluate_with(self._eval_fn, x, y)

    def predict(self, x) -> np.ndarray:
        return tf.cast(self.net(tf.constant(x), training=False), tf.float32).numpy()

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics, which stay per replica otherwise."""
        if self.net.buffers and self.hvd is None and self._size() > 1:
            for name, var in self.net.buffers.items():
                value = np.array(var.numpy())  # 0-d stays 0-d (ascontiguousarray: 1-d)
                self.world.allreduce_inplace(value, "sum", f"average buffer {name}")
                var.assign(value / self._size())
        elif self.net.buffers and self._size() > 1:
            names = list(self.net.buffers)
            avg = self.hvd.grouped_allreduce(
                [self.net.buffers[n] for n in names], op=self.hvd.Average
            )
            for n, value in zip(names, avg, strict=True):
                self.net.buffers[n].assign(value)

    # --- state ------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self.net.vars)

    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        return net_weights(self.net)

    def weight_shapes(self) -> dict[str, tuple]:
        shapes = {k: tuple(v.shape) for k, v in self.net.vars.items()}
        shapes.update({k: tuple(v.shape) for k, v in self.net.buffers.items()})
        return shapes

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.check_weights(weights, self.weight_shapes())
        assign_weights(self.net, weights)
        if self.zero is not None:
            self.zero.sync_shard()

    def export_state(self) -> dict[str, np.ndarray]:
        """The canonical state; under ZeRO a collective whose result is whole on rank 0."""
        if self.zero is not None:
            return {
                **with_model_prefix(self.get_weights()),
                **self._expert_optimizer_state(),
                **self.zero.export_optimizer(self._dense),
            }
        return {**with_model_prefix(self.get_weights()), **self.optimizer.export_state()}

    def export_owned_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Under ZeRO: (the replicated canonical state, {name: (shape, start, elements)}
        this rank alone holds, its optimizer shard), so a sharded checkpoint needs no
        communication."""
        replicated = {  # with experts: each rank its own
            **with_model_prefix(self.get_weights()),
            **self._expert_optimizer_state(),
            **self.zero.step_state(),
        }
        return replicated, self.zero.optimizer_pieces(self._dense)

    def _expert_optimizer_state(self) -> dict[str, np.ndarray]:
        """ZeRO with MoE: the local experts' slots (`optimizer/<slot>/<name>`)."""
        if getattr(self, "expert_optimizer", None) is None:
            return {}
        state = self.expert_optimizer.export_state()
        state.pop("optimizer/step", None)  # the shard's, the same count
        return state

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        self.set_weights(model_part(state))
        if self.zero is not None:
            if getattr(self, "expert_optimizer", None) is not None:
                self.expert_optimizer.import_state(state)
            self.zero.import_optimizer(self._dense, state)
            return
        self.optimizer.import_state(state)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)

    def versions(self) -> dict[str, str]:
        import horovod

        return {"framework": "tensorflow " + tf.__version__, "horovod": horovod.__version__}
