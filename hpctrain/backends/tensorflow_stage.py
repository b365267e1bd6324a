"""One pipeline stage in TensorFlow: a contiguous slice of a zoo model and its optimizer.

The slice is the backend's own `ZooNet` built from the stage's layers, so variables
carry canonical names and torch's update rules (`_Optimizer`) apply. Each forward runs
under its own `GradientTape`, kept with the micro-batch until its backward, which is
`tape.gradient(output, variables + [input], output_gradients=grad_from_next_stage)`.
ZeRO-1 (`attach_zero`): the accumulated gradients are reduce-scattered over the stage's
replicas once per step and each replica updates its shard (tensorflow_zero.py).

Layout: ZooNet takes canonical NCHW images and switches to NHWC at its first conv-type
layer. Between stages activations always travel NCHW, so a stage whose output is still
an image transposes it back before sending (inside the tape, so the gradient it gets
back is NCHW too); the next stage's ZooNet then switches to NHWC again by itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from ..moe.parallel import is_expert_param
from . import gradient_engine, tensorflow_moe
from .base import model_part, split_square_sums, with_model_prefix
from .gradient_engine import average_array
from .horovod_env import init_process_sets
from .stage_base import StageBase
from .tensorflow import (
    ZooNet,
    _Optimizer,
    assign_weights,
    dense_grads,
    net_weights,
    prepare_process,
    rng_state,
    set_rng_state,
    tf,
)
from .tensorflow_state import slot_bytes, state_memory_plan
from .tensorflow_zero import TensorFlowZero

# Kinds at which ZooNet moves images from NCHW to NHWC (see ZooNet.__call__).
_NHWC_KINDS = ("conv", "conv_bn", "resblock", "gap")


def init_replicas(comm, groups: list[list[int]], mine: int):
    """Horovod with one process set per stage (horovod_env.init_process_sets)."""
    import horovod.tensorflow as hvd

    return init_process_sets(hvd, comm, groups, mine)


def _run_nchw(net: ZooNet, x, training: bool):
    """net(x) with an image output returned in the canonical NCHW layout."""
    out = net(x, training=training)
    if len(out.shape) == 4 and any(spec.kind in _NHWC_KINDS for spec in net.layers):
        out = tf.transpose(out, [0, 3, 1, 2])
    return out


class TensorFlowStage(StageBase):
    """Layers [start, stop) of the model on tf variables, gradients accumulated in
    `acc` between micro-batches; see the module docstring."""

    prepare_process = staticmethod(prepare_process)

    def build(self, layers, weights) -> None:
        self.net = ZooNet(layers, dict(weights), groups=self.groups)
        self.opt = _Optimizer(self._ocfg, self.net.vars)
        self._vars = list(self.net.vars.values())
        # MoE experts in this stage: local to a rank of the stage's expert group
        self._experts = [i for i, n in enumerate(self.net.vars) if is_expert_param(n)]
        self._dense = [i for i, n in enumerate(self.net.vars) if not is_expert_param(n)]
        self.acc: list | None = None

    def attach_zero(self, replicas, bucket_bytes: int, transport=None) -> None:
        """ZeRO-1 over the stage's replicas (a guarded communicator): the optimizer
        holds this replica's shard of the stage's state only (no process-group
        `transport`: the config keeps those engines to the torch backend)."""
        if transport is not None:
            raise ValueError("the TensorFlow stage shards over MPI only")
        self.mpi = replicas
        self.zero = TensorFlowZero(
            replicas, self._vars, 1, bucket_bytes, lambda v: _Optimizer(self._ocfg, v)
        )
        self.opt = self.zero.optimizer
        self.zero.begin_step()

    def memory_plan(self) -> dict[str, float]:
        """The gradients and optimizer state this stage's rank will hold, and what of them
        it holds now (the limit check after the build): tensorflow_state's plan, and
        the sum the stage accumulates over micro-batches beside the tape's gradients."""
        plan = state_memory_plan(self.net, self.opt, self.zero, self._flat, slot_bytes(self.opt))
        if self.microbatches > 1:
            plan["grad"] += sum(int(np.prod(v.shape)) * 4 for v in self._vars)
        return plan

    def attach_mpi(self, replicas, transport=None) -> None:
        """The `mpi` engine: average over `replicas` (a guarded communicator) with one
        flat MPI_Allreduce per step instead of Horovod (no process-group `transport`:
        the config keeps those engines to the torch backend)."""
        if transport is not None:
            raise ValueError("the TensorFlow stage averages over MPI only")
        self.mpi = replicas
        sizes = [int(np.prod(self._vars[i].shape)) for i in self._dense]
        self._flat = gradient_engine.FlatMean(replicas, sizes)

    # --- the schedule's two actions --------------------------------------------
    def forward(self, micro: int, x: np.ndarray, y: np.ndarray | None, scale: float):
        """Run micro-batch `micro`; returns the activation to send (None on the last stage)."""
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            if not self.first:
                tape.watch(xt)
            out = _run_nchw(self.net, xt, training=True)
            aux = tensorflow_moe.aux_loss(self.net)  # MoE balancing, weighted per token
            if aux is not None:
                aux = aux * (float(np.prod(x.shape[:2])) * scale)
            if self.last:
                losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(y), out)
                loss = tf.reduce_sum(losses)
                target = loss * scale if aux is None else loss * scale + aux
        if self.last:
            self.loss_sum += float(loss)
            self.correct += int(np.sum(np.argmax(out.numpy(), -1) == y))
            out, aux = target, None
        self.stash[micro] = (tape, xt, out, aux)
        self.peak_stash = max(self.peak_stash, len(self.stash))
        return None if self.last else out.numpy()

    def backward(self, micro: int, grad: np.ndarray | None):
        """Backward of `micro`; returns the gradient for the previous stage (None on the first)."""
        tape, xt, out, aux = self.stash.pop(micro)
        sources = self._vars + ([] if self.first else [xt])
        upstream = None if self.last else tf.constant(grad)
        if aux is None:
            grads = tape.gradient(out, sources, output_gradients=upstream)
        else:  # the stage's balancing loss joins the gradient from the next stage
            grads = tape.gradient(
                [out, aux], sources, output_gradients=[upstream, tf.ones_like(aux)]
            )
        grads = dense_grads(grads, sources)
        n = len(self._vars)
        self.acc = (
            grads[:n]
            if self.acc is None
            else [a + g for a, g in zip(self.acc, grads[:n], strict=True)]
        )
        return None if self.first else grads[n].numpy()

    # --- the step ----------------------------------------------------------------
    def grad_square_sum(self) -> float:
        return sum(self.grad_square_sums(lambda name: False))

    def grad_square_sums(self, is_split) -> tuple[float, float]:
        """(split, replicated) squared gradient norms (base.split_square_sums)."""

        def squares():
            return [float(tf.reduce_sum(tf.cast(g, tf.float64) ** 2)) for g in self.acc]

        names = list(self.net.vars)
        return split_square_sums(names, squares, is_split, self.zero, self.groups.experts)

    def average_grads(self) -> float:
        """Average gradients over this stage's replicas; returns seconds spent."""
        if self.zero is not None:  # reduce-scatter: this replica's shard of the mean
            t0 = time.perf_counter()
            self.zero.reduce(self.acc)
            self.acc = None
            return time.perf_counter() - t0
        if self.mpi is not None:
            if self.mpi.size == 1:
                return 0.0
            t0 = time.perf_counter()
            dense = [self.acc[i] for i in self._dense]
            for view, g in zip(self._flat.views, dense, strict=True):
                view[:] = g.numpy().reshape(-1)
            self._flat.reduce()
            for i, view in zip(self._dense, self._flat.views, strict=True):
                self.acc[i] = tf.constant(view.reshape(self.acc[i].shape))
            if self._experts:  # scaled to the batches' mean, averaged over their copies
                names = list(self.net.vars)
                mine = [self.acc[i] for i in self._experts]
                mine = tensorflow_moe.expert_grads(
                    mine, [names[i] for i in self._experts], self.groups.experts
                )
                for i, g in zip(self._experts, mine, strict=True):
                    self.acc[i] = g
            return time.perf_counter() - t0
        if self.hvd is None or self.process_set.size() == 1:
            return 0.0
        t0 = time.perf_counter()
        with self.horovod_wait("Horovod stage gradient allreduce"):
            self.acc = self.hvd.grouped_allreduce(
                self.acc, op=self.hvd.Average, process_set=self.process_set
            )
        return time.perf_counter() - t0

    def apply(self, lr: float, clip_coef: float = 1.0) -> None:
        """One optimizer step with the accumulated (averaged, clipped) gradients."""
        if self.zero is not None:
            if clip_coef < 1.0:
                self.zero.shard_grad *= np.float32(clip_coef)
            self.zero.step(lr)  # the shard's update, then every replica's shard gathered
            self.zero.begin_step()
            return
        acc = self.acc if clip_coef >= 1.0 else [g * clip_coef for g in self.acc]
        self.opt.apply(acc, tf.constant(lr, tf.float32))
        self.acc = None

    def take_stats(self) -> tuple[float, int]:
        out = (self.loss_sum, self.correct)
        self.loss_sum, self.correct = 0.0, 0
        return out

    def moe_metrics(self, step_seconds: float) -> dict:
        """This step's MoE metrics of the stage's layers ({} without them); resets."""
        return tensorflow_moe.step_extra(self.net, step_seconds)

    # --- forward only ------------------------------------------------------------
    def infer(self, x: np.ndarray) -> np.ndarray:
        """Eval-mode forward (shape probing, validation); last stage returns logits."""
        return _run_nchw(self.net, tf.constant(x), training=False).numpy()

    def average_buffers(self) -> None:
        if self.mpi is not None:
            for name, var in self.net.buffers.items():
                var.assign(average_array(self.mpi, var.numpy(), f"average buffer {name}"))
            return
        if self.hvd is None or self.process_set.size() == 1 or not self.net.buffers:
            return
        names = list(self.net.buffers)
        with self.horovod_wait("Horovod stage buffer average"):
            avg = self.hvd.grouped_allreduce(
                [self.net.buffers[n] for n in names],
                op=self.hvd.Average,
                process_set=self.process_set,
            )
        for n, value in zip(names, avg, strict=True):
            self.net.buffers[n].assign(value)

    # --- canonical state ------------------------------------------------------------
    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        return net_weights(self.net)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        assign_weights(self.net, weights)
        if self.zero is not None:
            self.zero.sync_shard()

    def export_state(self) -> dict[str, np.ndarray]:
        """This stage's part of a checkpoint, in the data-parallel backend's layout
        (ZeRO: collective over the replicas, the optimizer state on replica 0)."""
        if self.zero is not None:
            names = list(self.net.vars)
            return {**with_model_prefix(self.get_weights()), **self.zero.export_optimizer(names)}
        return {**with_model_prefix(self.get_weights()), **self.opt.export_state()}

    def export_owned(self) -> tuple[dict, dict]:
        """ZeRO: (the weights, this replica's own ranges of the optimizer state as
        {name: (shape, first, elements)}), without communication."""
        step = self.zero.step_state()
        return (
            {**with_model_prefix(self.get_weights()), **step},
            self.zero.optimizer_pieces(list(self.net.vars)),
        )

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        """Take this stage's tensors (and their optimizer slots) from a full checkpoint."""
        self.set_weights(model_part(state))
        if self.zero is not None:
            self.zero.import_optimizer(list(self.net.vars), state)
            return
        self.opt.import_state(state)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)


def layer_forward_seconds(layers, layer_weights, x: np.ndarray, repeats: int = 3) -> list[float]:
    """Median forward time of each layer on input `x` (for `partition: time`), one
    layer built at a time: `layer_weights` gives each layer's {name: value} in order,
    so the model is never held whole."""
    out = []
    for spec, weights in zip(layers, layer_weights, strict=True):
        net = ZooNet([spec], weights)
        xt = tf.constant(x)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = _run_nchw(net, xt, training=False)
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
        x = y.numpy()
    return out
