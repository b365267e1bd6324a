"""ZeRO-3 for the TensorFlow backend: each rank keeps 1/N of every dense parameter.

The exchange is the torch backend's (exchange/zero3.py UnitGather: the same units,
slots, order and prefetch; backends/torch_zero3.py). What differs is how a unit's
parameters are freed during backward. torch's autograd saves views into a slot that
is refilled before the unit's backward; a `tf.GradientTape` keeps every tensor it
recorded until `tape.gradient` returns, so one tape over the forward would hold every
gathered unit at once, the whole model. So each unit runs twice, as activation
checkpointing does (`tf.recompute_grad`):

- forward, without a tape: unit by unit but the last, keeping only each unit's input;
- the last unit, once, under a tape with the loss;
- backward, from the last unit but one: the unit is gathered again (the two last are
  still in their slots), run again under its own tape, and differentiated with the
  gradient that arrives from above (`output_gradients`) and its MoE balancing loss,
  for its input, its flat parameters and its experts' variables. The flat gradient is
  already the segment's padded layout: it is reduce-scattered at once, in the same
  order on every rank (backward's), as stage 2.

The price of freeing parameters under a tape is one more forward of every unit but the
last, as `model.recompute` pays for activations. BatchNorm's running statistics are
updated by the first forward only (tensorflow_model.RECOMPUTE), so the numbers equal
one process's.

Memory per rank: the shard (the optimizer's variable, which the gathers read in place:
Psi x 4 / N), two slots of the largest unit (TF reads a unit in its slot
through DLPack, without a copy) and a unit's gradient while it is reduced. Traffic per
step as torch's ZeRO-3: about 1.5x a ring allreduce's, whatever N (exchange/zero3.py
gives it at 1,024 and 4,096 ranks).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from . import tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..exchange.zero import ZeroPartition, unit_plan
from ..exchange.zero3 import UnitGather, memory_figures
from ..moe.parallel import is_expert_param
from . import tensorflow_moe
from .tensorflow_model import RECOMPUTE, images_first, logit_sums, traced
from .tensorflow_zero import TensorFlowZero

SLOTS = 2  # gathered units at once: the running one and the prefetched one
ALIGN = 64  # bytes: TF's kernels require tensors at Eigen's alignment (EIGEN_MAX_ALIGN_BYTES)


def _aligned_zeros(n: int) -> np.ndarray:
    """float32 zeros whose first element sits on an ALIGN-byte boundary, so that TF can
    read a slot in place (numpy aligns small arrays to 16 bytes only)."""
    raw = np.zeros(n + ALIGN // 4, np.float32)
    skip = (-raw.ctypes.data % ALIGN) // 4
    return raw[skip : skip + n]


class TensorFlowZero3(TensorFlowZero):
    """The shard, the units' gathers and the per-unit forward and backward of a zoo
    net built without its dense parameters (tensorflow_model.build_model(lazy=True));
    the optimizer state and checkpoint layout are ZeRO-1/2's (TensorFlowZero)."""

    def __init__(self, world, net, unit_bytes: int, make_opt, init, prefetch: bool = True):
        self.net = net
        self.names = [n for n in net.shapes if not is_expert_param(n)]  # the dense ones
        self.shapes = [net.shapes[n] for n in self.names]
        sizes = [int(np.prod(s)) for s in self.shapes]
        index = {n: i for i, n in enumerate(self.names)}
        names = [[f"{s.name}.{p}" for p in s.params] for s in net.layers]
        per_layer = [[index[n] for n in layer if n in index] for layer in names]
        self.layer_units = unit_plan(per_layer, sizes, unit_bytes)
        units = [sorted(i for m in g for i in per_layer[m]) for g in self.layer_units]
        # MoE experts stay whole on their ranks (net.vars): each unit's, in model order
        self.expert_names = [n for n in net.shapes if is_expert_param(n)]
        self._unit_experts = [
            [n for m in g for n in names[m] if is_expert_param(n)] for g in self.layer_units
        ]
        self.expert_grads: dict = {}  # name -> this step's summed gradient
        self.part = part = ZeroPartition(world, sizes, 3, 0, units=units)
        largest = max(seg.padded for seg in part.segments)
        self._slots = [_aligned_zeros(largest) for _ in range(SLOTS)]
        self.shard = tf.Variable(self._fill(init), name="zero_shard")
        self.optimizer = make_opt(OrderedDict(zero_shard=self.shard))
        self._shard_np = self._shard_view()
        self.gather = UnitGather(part, self._shard_np, self._buffer, SLOTS, prefetch)
        self.shard_grad = np.zeros(part.shard_len, dtype=np.float32)
        self.grad_bytes_peak = 0
        self.gathered_peak = SLOTS * largest * 4  # the slots (TF reads them in place)
        self._fns: dict = {}
        self._comm = 0.0  # seconds in reduce-scatters during this micro-batch
        self._nchw: list[bool] | None = None

    # --- construction: the shard from the canonical initial values, unit by unit --------
    def _buffer(self, u: int) -> np.ndarray:
        return self._slots[u % SLOTS][: self.part.segments[u].padded]

    def _fill(self, init) -> np.ndarray:
        """The shard: parameters into their unit's slot, each full unit's piece into the
        shard; buffers (BatchNorm statistics) into the net's variables."""
        part = self.part
        shard = np.zeros(part.shard_len, np.float32)
        index = {n: i for i, n in enumerate(self.names)}
        left = [len(seg.params) for seg in part.segments]
        for key, value in init:
            i = index.get(key)
            if i is None:  # a buffer or an expert: whole in the net
                held = self.net.buffers.get(key, self.net.vars.get(key))
                held.assign(np.asarray(value, np.float32))
                continue
            u = part.segment_of[i]
            seg, buf = part.segments[u], self._buffer(u)
            if left[u] == len(seg.params):
                buf[:] = 0.0  # the padding stays zero
            at = part.offsets[i] - seg.start
            buf[at : at + part.sizes[i]] = np.asarray(value, np.float32).reshape(-1)
            left[u] -= 1
            if left[u] == 0:
                k = seg.piece(part.n)
                part.shard_view(shard, u)[:] = buf[part.rank * k : (part.rank + 1) * k]
        if any(left):  # a zoo layer the canonical specs do not name: a bug
            raise RuntimeError("no initial value for a parameter of the ZeRO-3 shard")
        return shard

    def _shard_view(self) -> np.ndarray:
        """The optimizer's shard as numpy without a copy (DLPack on the variable's
        value), for the gathers to send from. TF copies a variable's buffer on write
        while a view of it lives, so the view keeps its values until `step` replaces
        it: one shard in memory between steps, not a variable and a numpy copy."""
        return np.from_dlpack(self.shard.value())

    # --- one unit, traced once per unit and kind ------------------------------------------
    def _run(self, u: int, h, flat, training):
        """Unit u's layers on `h`, their parameters cut out of `flat` by one split: its
        gradient is one concat (slices would each add a whole unit of zeros)."""
        part, seg = self.part, self.part.segments[u]
        sizes = [part.sizes[i] for i in seg.params]  # laid out in this order
        pieces = tf.split(flat, [*sizes, seg.padded - seg.length])
        values = {
            self.names[i]: tf.reshape(piece, self.shapes[i])
            for i, piece in zip(seg.params, pieces, strict=False)
        }
        layers = [self.net.layers[m] for m in self.layer_units[u]]
        experts = self.net.vars  # MoE experts: the net's own variables

        def of(spec):
            keys = {p: f"{spec.name}.{p}" for p in spec.params}
            return {p: values[k] if k in values else experts[k] for p, k in keys.items()}

        out = self.net.run_layers(h, layers, of, training, self._nchw[u])
        return out, tensorflow_moe.aux_loss(self.net, [s.name for s in layers])

    def _fn(self, kind: str, u: int):
        key = (kind, u)
        if key not in self._fns:
            build = {"forward": self._forward, "backward": self._backward, "loss": self._loss}
            self._fns[key] = traced(build[kind](u), self.net)
        return self._fns[key]

    def _forward(self, u: int):
        def forward(h, flat, training):
            return self._run(u, h, flat, training)[0]

        return forward

    @staticmethod
    def _watch(tape, u: int, h, flat) -> None:
        tape.watch(flat)  # tensors, not variables: a tape records them when told
        if u > 0:
            tape.watch(h)

    def _sources(self, u: int, h, flat) -> list:
        """What a unit's tape differentiates: its flat parameters, its input (not the
        first unit's: the batch) and its experts' variables."""
        experts = [self.net.vars[n] for n in self._unit_experts[u]]
        return [flat, *([h] if u > 0 else []), *experts]

    def _backward(self, u: int):
        """The unit again under a tape, differentiated with the gradient from above and
        its balancing loss (MoE; `weight`: tokens x scale, as the one-tape step's)."""

        def backward(h, flat, dy, weight):
            with tf.GradientTape() as tape:
                self._watch(tape, u, h, flat)
                out, aux = self._run(u, h, flat, RECOMPUTE)
                balance = None if aux is None else aux * weight
            sources = self._sources(u, h, flat)
            if balance is None:
                return tape.gradient(out, sources, output_gradients=dy)
            return tape.gradient([out, balance], sources, [dy, tf.ones_like(balance)])

        return backward

    def _loss(self, u: int):
        """The last unit with the loss (the summed loss times `scale`)."""

        def loss(h, flat, y, scale):
            with tf.GradientTape() as tape:
                self._watch(tape, u, h, flat)
                out, aux = self._run(u, h, flat, True)
                logits = tf.cast(self.net.cast_out(out), tf.float32)
                loss_sum, correct = logit_sums(logits, y)
                scaled = loss_sum * scale  # on the tape: what is differentiated
                if aux is not None:
                    scaled += aux * tf.cast(tf.size(y), tf.float32) * scale
            return loss_sum, correct, tape.gradient(scaled, self._sources(u, h, flat))

        return loss

    def _unit(self, u: int, ahead: int | None):
        """Unit u's parameters as a tensor on its slot's memory (DLPack: no copy);
        `ahead` prefetched. A gather refills the slot only after the unit's release,
        when no computation reads the tensor any more (eager ops have returned)."""
        self.gather.need(u)
        self.gather.prefetch(ahead)
        return tf.experimental.dlpack.from_dlpack(self._buffer(u).__dlpack__())

    # --- a micro-batch -----------------------------------------------------------------
    def _start(self, x):
        if self._nchw is None:
            first = images_first(self.net.layers, np.ndim(x) == 4)
            self._nchw = [first[g[0]] for g in self.layer_units]
        return self.net.cast_in(tf.constant(x))

    def forward_backward(self, x, y, scale):
        """One micro-batch's loss, its correct predictions and the seconds spent in the
        exchange (gathers waited for, reduce-scatters); its gradient's shard is added into
        `shard_grad`, every unit reduce-scattered as backward finishes it."""
        last = len(self.part.segments) - 1
        self._comm, waited = 0.0, self.gather.waited
        h, inputs = self._start(x), []
        for u in range(last):
            flat = self._unit(u, u + 1)
            inputs.append(h)
            h = self._fn("forward", u)(h, flat, True)
            self.gather.release(u)
        flat = self._unit(last, last - 1 if last > 0 else None)
        loss, correct, grads = self._fn("loss", last)(h, flat, tf.constant(y), scale)
        dh = self._take(last, grads)
        weight = tf.cast(tf.size(y), tf.float32) * scale  # the balancing losses' weight
        for u in reversed(range(last)):
            flat = self._unit(u, u - 1 if u > 0 else None)
            grads = self._fn("backward", u)(inputs[u], flat, dh, weight)
            inputs[u] = None  # only the inputs still ahead are kept
            dh = self._take(u, grads)
        self.gather.release_all()
        return loss, correct, self._comm + self.gather.waited - waited

    def _take(self, u: int, grads: list):
        """A unit's gradients: the flat one reduce-scattered, the experts' summed over
        the step; returns its input's (None for the first unit)."""
        self._reduce(u, grads[0])
        at = 2 if u > 0 else 1
        for name, g in zip(self._unit_experts[u], grads[at:], strict=True):
            g = tf.convert_to_tensor(g)
            held = self.expert_grads.get(name)
            self.expert_grads[name] = g if held is None else held + g
        return grads[1] if u > 0 else None

    def _reduce(self, u: int, grad) -> None:
        self.gather.release(u)
        seg = self.part.segments[u]
        if grad is None:
            buf = np.zeros(seg.padded, np.float32)
        else:  # a read-only view where it is only sent, a copy where it is scaled
            buf = np.from_dlpack(grad) if self.part.n > 1 else grad.numpy()
        held = buf.nbytes + self.shard_grad.nbytes
        self.grad_bytes_peak = max(self.grad_bytes_peak, held)
        t0 = time.perf_counter()
        self.part.reduce_segment(u, buf, self.shard_grad)
        self._comm += time.perf_counter() - t0

    def take_expert_grads(self) -> list | None:
        """This step's expert gradients in `expert_names` order (None without experts)."""
        if not self.expert_names:
            return None
        grads, self.expert_grads = self.expert_grads, {}
        return [grads[n] for n in self.expert_names]

    def logits(self, x) -> tf.Tensor:
        """The model's float32 output for `x` (inference: collective, unit by unit)."""
        last = len(self.part.segments) - 1
        h = self._start(x)
        for u in range(last + 1):
            flat = self._unit(u, u + 1 if u < last else None)
            h = self._fn("forward", u)(h, flat, False)
            self.gather.release(u)
        return tf.cast(self.net.cast_out(h), tf.float32)

    # --- a step ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.expert_grads = {}
        self.shard_grad[:] = 0.0
        self.grad_bytes_peak = self.shard_grad.nbytes
        self.part.take_sent()  # an evaluation's gathers since the last step: not its traffic

    def step(self, lr: float) -> None:
        self.optimizer.apply([tf.constant(self.shard_grad)], tf.constant(lr, tf.float32))
        self._use_new_shard()

    def _use_new_shard(self) -> None:
        """The shard changed: every unit is gathered afresh, from the new values (the
        old view's buffer goes once the gather lets go of it)."""
        self._shard_np = self._shard_view()
        self.gather.use_shard(self._shard_np)

    def sync_shard(self) -> None:
        """Nothing to do: the shard is the parameters (ZeRO-1/2 re-read it from them)."""

    # --- the whole parameters, for state -----------------------------------------------
    def all_params(self) -> list[np.ndarray]:
        """Every dense parameter, whole, on every rank (collective, one unit at a time)."""
        out: list[np.ndarray | None] = [None] * len(self.names)
        part = self.part
        for u, seg in enumerate(part.segments):
            self.gather.need(u)
            buf = self._buffer(u)
            for i in seg.params:
                at = part.offsets[i] - seg.start
                out[i] = buf[at : at + part.sizes[i]].reshape(self.shapes[i]).copy()
            self.gather.release(u)
        return out

    def root_params(self) -> list[np.ndarray] | None:
        """Every dense parameter on rank 0 (None elsewhere): one gather of the shards."""
        what = "ZeRO-3 checkpoint: gather parameters"
        return self.part.gather_arrays(self._shard_np, self.shapes, what)

    def param_pieces(self, names: list[str]) -> dict:
        """This rank's own part of every `model/<name>` (no communication)."""
        keys = [f"model/{n}" for n in names]
        return self.part.owned_pieces(self._shard_np, keys, self.shapes)

    def load_params(self, arrays: list[np.ndarray]) -> None:
        """The shard from whole parameters (every rank holds them: a load). A gather
        still on its way reads the old view, which the assignment leaves intact."""
        self.shard.assign(self.part.shard_of(self.part.flatten(arrays)))
        self._use_new_shard()

    def memory(self, slots: int) -> dict[str, float]:
        opt = self.optimizer_bytes()
        return memory_figures(self.gather, self.gathered_peak, self.grad_bytes_peak, opt, slots)
