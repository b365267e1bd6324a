"""TensorFlow process set-up, random streams and the backend's state: threads,
deterministic kernels, the seeds of every stream, the Keras/TF generator states a
checkpoint carries, and TensorFlowBackend's canonical state and memory figures."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np

from . import tf_env, tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..moe.parallel import forget_jitter_rngs
from ..runtime.memory import peak_rss_bytes
from . import tensorflow_user
from .base import OPTIMIZER_SLOTS, model_part, replicated_memory_plan, with_model_prefix
from .tensorflow_model import assign_weights, net_weights


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
    forget_jitter_rngs()  # MoE layers' noise streams: made afresh by this run's layers


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


def state_memory_plan(net, optimizer, zero, flat, opt_now: float) -> dict[str, float]:
    """Bytes of gradients and optimizer state a rank will hold once training runs
    (`grad`, `optimizer`) and how much of them is resident now (`*_now`: the slots
    exist from the start; gradients come from the tape, numpy buffers fill at use), for
    `net`'s variables under `zero` (ZeRO-1/2/3 or None) with the engine's `flat`
    buffer. The optimizer's figure includes the temporaries of its update (one
    variable's at a time, see _Optimizer.apply), which come on top of the slots."""
    slots = len(OPTIMIZER_SLOTS[optimizer.kind])
    workspace = float(optimizer.workspace_bytes())
    if zero is not None and zero.part.stage == 3:  # a unit's gradient beside the shard's
        e, part = zero.part.expected_bytes(slots), zero.part
        return {
            "grad": e["zero_model_grad_bytes"] + part.largest_segment_bytes(),
            "grad_now": 0.0,
            "optimizer": e["zero_model_optimizer_bytes"] + workspace,
            "optimizer_now": opt_now,
        }
    if zero is not None:
        e = zero.part.expected_bytes(slots)
        return {
            # the tape returns every local gradient at once, then they are reduced;
            # the step hands the shard's gradient to TF as a copy (tf.constant)
            "grad": e["zero_model_param_bytes"]
            + 2 * e["zero_model_grad_bytes"]
            + zero.part.largest_segment_bytes(),
            "grad_now": 0.0,
            "optimizer": e["zero_model_optimizer_bytes"] + workspace,
            "optimizer_now": opt_now,
        }
    trainable = sum(int(np.prod(v.shape)) * 4 for v in net.vars.values())
    plan = replicated_memory_plan(trainable, flat, slots, opt_now)
    plan["optimizer"] += workspace
    return plan


def slot_bytes(optimizer) -> float:
    """Bytes of an _Optimizer's slot variables (they exist from its construction)."""
    return float(
        sum(
            int(np.prod(v.shape)) * 4
            for values in optimizer.slots.values()
            for v in values.values()
        )
    )


class TensorFlowStateMixin:
    """For TensorFlowBackend: needs self.net, self.optimizer, self.zero, self._dense,
    self._flat and (ZeRO with MoE) self.expert_optimizer."""

    def memory_plan(self) -> dict[str, float]:
        """state_memory_plan of this rank's model."""
        opt_now = self.memory()["mem_optimizer_bytes"]
        return state_memory_plan(self.net, self.optimizer, self.zero, self._flat, opt_now)

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
                "mem_optimizer_bytes": slot_bytes(self.optimizer),
            }
        out["mem_peak_rss_bytes"] = float(peak_rss_bytes())
        return out

    @property
    def _sharded(self) -> bool:
        """ZeRO-3: the dense parameters exist as this rank's shard only."""
        return self.zero is not None and self.zero.part.stage == 3

    def param_names(self) -> list[str]:
        return list(self.net.shapes)

    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        if not self._sharded:
            return net_weights(self.net)
        return self._with_buffers(self.zero.all_params())  # collective

    def _with_buffers(self, dense: list[np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """ZeRO-3's whole dense parameters (in `zero.names` order) among the experts, in
        `param_names` order, then the net's buffers."""
        gathered = dict(zip(self.zero.names, dense, strict=True))
        whole = self._unsharded_weights()
        out = OrderedDict((n, gathered[n] if n in gathered else whole[n]) for n in self.net.shapes)
        out.update((k, whole[k]) for k in self.net.buffers)
        return out

    def _unsharded_weights(self) -> OrderedDict[str, np.ndarray]:
        """Copies of what ZeRO-3 keeps whole on this rank: MoE experts and buffers."""
        held = [*self.net.vars.items(), *self.net.buffers.items()]
        return OrderedDict((k, v.numpy().copy()) for k, v in held)

    def weight_shapes(self) -> dict[str, tuple]:
        shapes = dict(self.net.shapes)
        shapes.update({k: tuple(v.shape) for k, v in self.net.buffers.items()})
        return shapes

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.check_weights(weights, self.weight_shapes())
        if self._sharded:  # experts and buffers whole, the dense parameters into the shard
            for k, v in [*self.net.vars.items(), *self.net.buffers.items()]:
                v.assign(np.asarray(weights[k], dtype=np.float32))
            self.zero.load_params([weights[n] for n in self.zero.names])
            return
        assign_weights(self.net, weights)
        if self.zero is not None:
            self.zero.sync_shard()

    def _root_weights(self) -> OrderedDict[str, np.ndarray]:
        """The weights for a checkpoint whose result is whole on rank 0: ZeRO-3 gathers
        its shards to rank 0 only (one Gatherv), never onto every rank."""
        if not self._sharded:
            return self.get_weights()
        dense = self.zero.root_params()
        if dense is None:  # not rank 0 (of the data ranks): its result is not saved
            return self._unsharded_weights()
        return self._with_buffers(dense)

    def export_state(self, staged: bool = False) -> dict[str, np.ndarray]:
        """The canonical state; under ZeRO a collective whose result is whole on rank 0.
        Host copies, ready on return whether `staged` or not (Backend.export_state)."""
        if self.zero is not None:
            return {
                **with_model_prefix(self._root_weights()),
                **self._expert_optimizer_state(),
                **self.zero.export_optimizer(self._dense),
            }
        return {**with_model_prefix(self.get_weights()), **self.optimizer.export_state()}

    def export_owned_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Under ZeRO: (the replicated canonical state, {name: (shape, start, elements)}
        this rank alone holds, its optimizer shard), so a sharded checkpoint needs no
        communication."""
        # ZeRO-3: experts and buffers (its dense parameters are pieces below)
        weights = self._unsharded_weights() if self._sharded else self.get_weights()
        replicated = {  # with experts: each rank its own
            **with_model_prefix(weights),
            **self._expert_optimizer_state(),
            **self.zero.step_state(),
        }
        pieces = self.zero.optimizer_pieces(self._dense)
        if self._sharded:  # each rank writes its own parameter ranges
            pieces.update(self.zero.param_pieces(self._dense))
        return replicated, pieces

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
