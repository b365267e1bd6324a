"""The TensorFlow side of a parameter-server worker: numpy weights in, numpy gradients out.

Like torch_worker.py, without Horovod and without an optimizer: the zoo model
(`build_model` / ZooNet from backends/tensorflow.py) on plain variables, gradients from
a `tf.GradientTape` in one traced function, everything exchanged as float32 numpy arrays
under the canonical (torch-layout) names.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..models import zoo
from .base import EvalStats
from .tensorflow import (
    build_model,
    dense_grads,
    eval_sums,
    evaluate_with,
    prepare_process,
    rng_state,
    set_rng_state,
    tf,
    traced,
)
from .worker_base import WorkerBase


class TensorFlowWorker(WorkerBase):
    """One zoo model on this rank, its gradients from one traced tape; no optimizer
    (the servers own it)."""

    name = "tensorflow"
    prepare_process = staticmethod(prepare_process)

    def build(self, model_cfg: dict, inp: zoo.InputSpec, seed: int, groups) -> None:
        self.net = build_model(model_cfg, inp, seed, groups=groups)
        self.params = self.net.vars
        self.buffers = self.net.buffers
        self._grad_fn = traced(self._grads, self.net)
        self._eval_fn = traced(lambda x, y: eval_sums(self.net, x, y), self.net)

    def param_shapes(self) -> OrderedDict[str, tuple]:
        return OrderedDict((k, tuple(v.shape)) for k, v in self.params.items())

    def set_params(self, arrays: dict[str, np.ndarray]) -> None:
        for k, v in self.params.items():
            v.assign(arrays[k])

    def get_buffers(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v.numpy().copy()) for k, v in self.buffers.items())

    def set_buffers(self, arrays: dict[str, np.ndarray]) -> None:
        for k, v in self.buffers.items():
            v.assign(np.asarray(arrays[k], dtype=np.float32))

    def _grads(self, x, y, scale):
        with tf.GradientTape() as tape:
            logits = self.net(x, training=True)
            loss_sum = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            scaled = loss_sum * scale
        variables = list(self.params.values())
        grads = dense_grads(tape.gradient(scaled, variables), variables)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.int64))
        return loss_sum, correct, grads

    def gradients(self, micro_batches) -> tuple[dict[str, np.ndarray], float, int, int]:
        """Mean gradient over all the step's samples, as numpy; plus loss sum, correct, count."""
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        scale = tf.constant(1.0 / total, tf.float32)
        acc, loss_sum, correct = None, 0.0, 0
        for x, y in micro_batches:
            loss, corr, grads = self._grad_fn(tf.constant(x), tf.constant(y), scale)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
            loss_sum += float(loss)
            correct += int(corr)
        out = {k: g.numpy() for k, g in zip(self.params, acc)}
        return out, loss_sum, correct, total

    def evaluate(self, x, y) -> EvalStats:
        return evaluate_with(self._eval_fn, x, y)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)
