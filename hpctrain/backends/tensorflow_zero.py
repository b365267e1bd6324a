"""ZeRO-1/2 for the TensorFlow backend (the layout and the MPI side: exchange/zero.py).

The optimizer (torch's update rules in tf ops, tensorflow.py) holds one flat variable,
this rank's shard, and so only the shard's slots. `tape.gradient` returns every
gradient at once, so nothing can be reduced during backward: each segment is copied
into its own buffer and reduce-scattered right after the tape (stage 2: after every
micro-batch, so accumulation keeps only the shard; stage 1: once, after the last).
What TensorFlow holds during the tape (the whole gradient) is reported as measured.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..exchange.zero import ZeroPartition
from .base import OPTIMIZER_SLOTS


class TensorFlowZero:
    def __init__(self, world, variables: list, stage: int, bucket_bytes: int, make_opt):
        sizes = [int(np.prod(v.shape)) for v in variables]
        self.part = part = ZeroPartition(world, sizes, stage, bucket_bytes)
        self.variables = variables
        self.shapes = [tuple(v.shape) for v in variables]
        self.shard = tf.Variable(np.zeros(part.shard_len, np.float32), name="zero_shard")
        self.optimizer = make_opt(OrderedDict(zero_shard=self.shard))
        self.shard_grad = np.zeros(part.shard_len, dtype=np.float32)
        self.grad_bytes_peak = 0
        self.sync_shard()

    def begin_step(self) -> None:
        self.shard_grad[:] = 0.0
        self.grad_bytes_peak = self.shard_grad.nbytes

    def reduce(self, grads: list) -> None:
        """Reduce-scatter `grads` (one per variable, as the tape returns them) segment by
        segment, in the same order on every rank, into this rank's shard of the mean."""
        part = self.part
        held = sum(int(np.prod(g.shape)) * 4 for g in grads)
        for s in reversed(range(len(part.segments))):
            seg = part.segments[s]
            if len(seg.params) == 1 and seg.padded == seg.length:
                buf = np.asarray(grads[seg.params[0]]).reshape(-1)  # no copy needed
                extra = 0
            else:
                buf = np.zeros(seg.padded, dtype=np.float32)
                for i in seg.params:
                    at = part.offsets[i] - seg.start
                    buf[at : at + part.sizes[i]] = np.asarray(grads[i]).reshape(-1)
                extra = buf.nbytes
            self.grad_bytes_peak = max(self.grad_bytes_peak, held + extra + self.shard_grad.nbytes)
            part.reduce_segment(s, buf, self.shard_grad)

    def clip(self, max_norm: float, split=None, extra_sq: float = 0.0) -> float:
        """torch's clip_grad_norm_ rule on the whole gradient, from the shards (`split`:
        tensor parallelism, see ZeroPartition.global_norm; `extra_sq`: the squares of
        gradients outside the partition, MoE experts). Returns the coefficient."""
        return self.part.clip(self.shard_grad, max_norm, split, extra_sq)

    def step(self, lr: float) -> None:
        self.optimizer.apply([tf.constant(self.shard_grad)], tf.constant(lr, tf.float32))
        part, shard = self.part, self.shard.numpy()
        for s, seg in enumerate(part.segments):  # one segment buffer at a time
            buf = np.empty(seg.padded, dtype=np.float32)
            part.gather_segment(s, shard, buf)
            for i in seg.params:
                at = part.offsets[i] - seg.start
                var = self.variables[i]
                var.assign(buf[at : at + part.sizes[i]].reshape(var.shape))

    def sync_shard(self) -> None:
        """The shard from the (replicated) variables: after a broadcast or a load."""
        flat = self.part.flatten([v.numpy() for v in self.variables])
        self.shard.assign(self.part.shard_of(flat))

    # --- checkpoints: the canonical layout ---------------------------------------------
    def export_optimizer(self, names: list[str]) -> dict[str, np.ndarray]:
        """`optimizer/<slot>/<name>` for every dense variable, on rank 0 (collective)."""
        opt, state = self.optimizer, {}
        for slot, values in opt.slots.items():
            full = self.part.gather_full(
                values["zero_shard"].numpy(), f"ZeRO checkpoint: gather {slot}"
            )
            if full is None:
                continue
            views = self.part.views(full)
            for name, shape, view in zip(names, self.shapes, views, strict=True):
                state[f"optimizer/{slot}/{name}"] = view.reshape(shape).copy()
        return {**state, **self.step_state()}

    def step_state(self) -> dict[str, np.ndarray]:
        """`optimizer/step` (Adam's step count, the same on every rank), or nothing."""
        opt = self.optimizer
        if opt.kind != "adam":
            return {}
        return {"optimizer/step": np.array(int(opt.step.numpy()), dtype=np.int64)}

    def optimizer_pieces(self, names: list[str]) -> dict:
        """This rank's own part of every `optimizer/<slot>/<name>` (no communication):
        what a sharded checkpoint writes from this rank."""
        pieces = {}
        for slot, values in self.optimizer.slots.items():
            keys = [f"optimizer/{slot}/{n}" for n in names]
            shard = values["zero_shard"].numpy()
            pieces.update(self.part.owned_pieces(shard, keys, self.shapes))
        return pieces

    def import_optimizer(self, names: list[str], state: dict) -> None:
        opt = self.optimizer
        for slot in OPTIMIZER_SLOTS[opt.kind]:
            keys = [f"optimizer/{slot}/{n}" for n in names]
            missing = [k for k in keys if k not in state]
            if missing:
                raise ValueError(f"optimizer state {missing[0]} missing")
            full = self.part.flatten([state[k] for k in keys])
            opt.slots[slot]["zero_shard"].assign(self.part.shard_of(full))
        opt.step.assign(int(state.get("optimizer/step", 0)))
        # As the replicated optimizer: a restored SGD buffer continues as momentum
        # (decided from the whole state, so every rank decides the same).
        opt.started.assign(
            opt.kind == "sgd"
            and any(np.any(state[f"optimizer/momentum_buffer/{n}"]) for n in names)
        )

    def optimizer_bytes(self) -> float:
        return float(
            sum(
                int(np.prod(v.shape)) * 4
                for values in self.optimizer.slots.values()
                for v in values.values()
            )
        )

    def memory(self, slots: int) -> dict[str, float]:
        return {
            "mem_param_bytes": float(sum(int(np.prod(v.shape)) * 4 for v in self.variables)),
            "mem_grad_bytes": float(self.grad_bytes_peak),
            "mem_optimizer_bytes": self.optimizer_bytes(),
            **self.part.expected_bytes(slots),
        }
