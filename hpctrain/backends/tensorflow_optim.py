"""torch's optimizer update rules and gradient clipping in tf ops (the same numbers as
torch's SGD/Adam and clip_grad_norm_)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import tf_env, tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..tensor import parallel as tensor_parallel
from .base import OPTIMIZER_SLOTS, split_square_sums

# Elementwise intermediates of one variable's optimizer update alive at once, at most
# (Adam: b1*m, (1-b1)*g, g*g, b2*v, ... scheduled together by TF's executor).
UPDATE_TEMPORARIES = 4


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

    @tf.function(reduce_retracing=True, autograph=False)  # Python branches only
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


def _clip_tensor_parallel(grads, names, max_norm, groups):
    """torch's rule on the whole model: squares of split variables summed over the
    tensor axis, those of experts over their group (each expert lives on one of its
    ranks), replicated ones counted once."""

    def squares():
        return [float(tf.reduce_sum(tf.cast(g, tf.float64) ** 2)) for g in grads]

    split, whole = split_square_sums(
        names, squares, tensor_parallel.split_kind, experts=groups.experts
    )
    split = float(groups.tensor.sum_squares(np.array([split], np.float64), "gradient norm")[0])
    coef = max_norm / ((whole + split) ** 0.5 + 1e-6)
    return [g * coef for g in grads] if coef < 1.0 else grads
