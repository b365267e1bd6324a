"""ZeRO-1/2/3: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3,
see zero3.py) split over the data ranks.

The dense parameters, in registration order, form one flat float32 vector. It is cut
into segments (stage 1: one; stage 2: `stage2_segments`, so a segment can be reduced as
soon as backward has finished it), each padded to a multiple of N. Rank r
owns piece r of every segment; its shard is those pieces in segment order. Per step:

- gradients: one `MPI_Reduce_scatter` per segment; each rank keeps the mean of its piece;
- clipping: the global norm is the square root of the allreduced shard sums (two
  numbers, kept where the shard lives);
- the optimizer updates only the shard (its state exists only for the shard);
- parameters: one `MPI_Allgatherv` per segment writes every piece into every replica.

Per rank and step, reduce-scatter and allgather each send (N-1)/N of the flat vector,
the same bytes as a ring allreduce: the cost does not grow with N (1,024 or 4,096
ranks: still < 2x the vector), and memory per rank is Psi (parameters) + the gradient
(stage 1: Psi; stage 2: Psi/N + what backward holds) + K*Psi/N of optimizer state.

The per-step collectives and arithmetic go through the transport (`transport.py`), so
the same code runs on host numpy over MPI (`runtime.comm.GuardedComm`) and on torch
tensors of the rank's device over a process group (`backends/torch_transport.py`).

Checkpoints stay canonical: `gather_full` collects a shard-shaped array into the full
flat vector on rank 0 only (`MPI_Gatherv`: rank 0 receives K*Psi, the others send
K*Psi/N; never an allgather, which would put the whole state on every rank), and
`shard_of` takes this rank's pieces of a full vector, so a ZeRO run resumes as plain
data parallelism, at another world size or in the other backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.host_arrays import HostArrays
from .transport import Transport


def unit_plan(module_params: list[list[int]], sizes: list[int], unit_bytes: int) -> list[list[int]]:
    """ZeRO-3's units: consecutive modules (in forward order) merged until a unit holds
    at least `unit_bytes` of float32 parameters; returns the module indices per unit.
    Modules without parameters join their neighbours. A unit is what is gathered whole
    before it runs, so its size trades peak memory (two units live: the running one and
    the prefetched one) against the number of collectives per step."""
    units, current, filled = [], [], 0
    for m, params in enumerate(module_params):
        current.append(m)
        filled += sum(sizes[i] for i in params) * 4
        if filled >= unit_bytes:
            units.append(current)
            current, filled = [], 0
    if current:
        if units and filled == 0:
            units[-1].extend(current)  # trailing modules without parameters
        else:
            units.append(current)
    return units


def stage2_segments(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per segment, ascending: backward's buckets (last layer first,
    >= bucket_bytes each), except that a parameter of bucket_bytes or more is a segment
    of its own, so its gradient is reduce-scattered where it lies, without a copy."""
    groups, current, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        if sizes[i] * 4 >= bucket_bytes:
            if current:
                groups.append(current)
                current, filled = [], 0
            groups.append([i])
            continue
        current.append(i)
        filled += sizes[i] * 4
        if filled >= bucket_bytes:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return [sorted(g) for g in reversed(groups)]


@dataclass(frozen=True)
class Segment:
    """A contiguous run of parameters in the padded flat vector."""

    params: tuple[int, ...]  # parameter indices, ascending
    start: int  # offset in the padded flat vector
    length: int  # elements of real parameters
    padded: int  # length rounded up to a multiple of N
    shard_start: int  # offset of this segment's piece in a rank's shard

    def piece(self, n: int) -> int:
        return self.padded // n


class ZeroPartition:
    """The flat layout of the dense parameters and this rank's shard of it."""

    def __init__(
        self,
        comm: Transport | None,
        sizes: list[int],
        stage: int,
        bucket_bytes: int,
        units=None,
        host=None,
    ):
        """`comm`: the transport of the per-step collectives, whose array type the
        gradient and shard buffers have (None: one process, numpy). `host`: the guarded
        MPI communicator of the checkpoint gathers (host numpy; default `comm`).
        `units` (stage 3): the parameter indices of each unit, in forward order; each
        unit is one segment, gathered and reduce-scattered whole."""
        if stage not in (1, 2, 3) or (stage == 3) != (units is not None):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 (3 with units), got {stage}")
        self.comm = comm
        self.host = comm if host is None else host
        self.arrays = comm if comm is not None else HostArrays()  # the array seam
        self.stage = stage
        self.n = comm.size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        self.sizes = [int(s) for s in sizes]
        if stage == 3:
            groups = [list(u) for u in units]
        elif stage == 2:
            groups = stage2_segments(self.sizes, bucket_bytes)
        else:
            groups = [list(range(len(sizes)))]
        self.segments: list[Segment] = []
        self.offsets = [0] * len(self.sizes)
        start = shard = 0
        for group in groups:
            offset = start
            for i in group:
                self.offsets[i] = offset
                offset += self.sizes[i]
            length = offset - start
            padded = -(-max(length, 1) // self.n) * self.n
            self.segments.append(Segment(tuple(group), start, length, padded, shard))
            start += padded
            shard += padded // self.n
        self.flat_len = start
        self.shard_len = shard
        self.segment_of = {i: s for s, seg in enumerate(self.segments) for i in seg.params}
        self._sent = 0

    # --- layout -------------------------------------------------------------------------
    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """One view per parameter into a padded flat vector (parameter order)."""
        return [flat[o : o + s] for o, s in zip(self.offsets, self.sizes, strict=True)]

    def segment_view(self, flat: np.ndarray, s: int) -> np.ndarray:
        seg = self.segments[s]
        return flat[seg.start : seg.start + seg.padded]

    def shard_view(self, shard: np.ndarray, s: int) -> np.ndarray:
        seg = self.segments[s]
        return shard[seg.shard_start : seg.shard_start + seg.piece(self.n)]

    def shard_of(self, flat: np.ndarray, out=None) -> np.ndarray:
        """This rank's pieces of a full padded flat vector (a copy; into `out`, a
        shard-shaped buffer of any array type, when given)."""
        if out is None:
            out = np.empty(self.shard_len, dtype=flat.dtype)
        for s, seg in enumerate(self.segments):
            k = seg.piece(self.n)
            self.shard_view(out, s)[:] = flat[
                seg.start + self.rank * k : seg.start + (self.rank + 1) * k
            ]
        return out

    def flatten(self, arrays: list[np.ndarray]) -> np.ndarray:
        """Per-parameter arrays into a new padded flat vector (pads zero)."""
        flat = np.zeros(self.flat_len, dtype=np.float32)
        for view, a in zip(self.views(flat), arrays, strict=True):
            view[:] = np.asarray(a, dtype=np.float32).reshape(-1)
        return flat

    def owned_ranges(self) -> list[tuple[int, int, int, int]]:
        """What this rank's shard holds: (parameter index, first element in the
        parameter, first element in the shard, count), for checkpoints written by owners."""
        out = []
        for seg in self.segments:
            k = seg.piece(self.n)
            lo = seg.start + self.rank * k
            for i in seg.params:
                a = max(lo, self.offsets[i])
                b = min(lo + k, self.offsets[i] + self.sizes[i])
                if b > a:
                    out.append((i, a - self.offsets[i], seg.shard_start + a - lo, b - a))
        return out

    def owned_pieces(self, shard: np.ndarray, names: list[str], shapes: list[tuple]) -> dict:
        """{name: (shape, first element, elements)} of a shard-shaped array: this rank's
        part of every parameter-shaped tensor (parameters without elements: rank 0's)."""
        pieces = {}
        for i, start, at, count in self.owned_ranges():
            pieces[names[i]] = (tuple(shapes[i]), start, shard[at : at + count])
        if self.rank == 0:
            for i, size in enumerate(self.sizes):
                if size == 0:
                    pieces[names[i]] = (tuple(shapes[i]), 0, shard[:0])
        return pieces

    # --- communication --------------------------------------------------------------------
    def reduce_segment(self, s: int, grads: np.ndarray, into: np.ndarray) -> None:
        """Mean over the ranks of segment `s` of a padded flat gradient vector (or of the
        segment alone: len == padded), added into this rank's piece of `into` (a shard)."""
        seg = self.segments[s]
        buf = grads if len(grads) == seg.padded else self.segment_view(grads, s)
        k = seg.piece(self.n)
        if self.n == 1:
            mine = buf
        else:
            mine = self.comm.reduce_scatter_sum(
                buf, [k] * self.n, f"ZeRO-{self.stage} gradient reduce-scatter (segment {s})"
            )
            self._sent += (self.n - 1) * k * 4
        self.arrays.scale_(mine, 1.0 / self.n)  # in place: no temporary of a piece
        self.shard_view(into, s)[:] += mine

    def reduce_all(self, grads: np.ndarray, into: np.ndarray) -> None:
        for s in range(len(self.segments)):
            self.reduce_segment(s, grads, into)

    def global_square_sum(self, shard_grad: np.ndarray, split=None):
        """The sum of squares of the whole (averaged) gradient from the shards (one
        allreduce of two numbers), a 0-d float64 array where the shard lives.

        `split` = (mask over the shard, tensor group): with tensor parallelism the
        masked elements belong to tensor-split parameters, whose squares are also summed
        over the tensor axis (replicated ones are counted once)."""
        sums = self.square_sum_array(shard_grad, None if split is None else split[0])
        if split is None:
            return sums[0] + sums[1]
        masked = split[1].sum_squares(self.arrays.copy(sums[:1]), "ZeRO gradient norm")
        return sums[1] + masked[0]

    def clip(self, shard_grad: np.ndarray, max_norm: float, split=None, extra_sq=0.0):
        """torch's clip_grad_norm_ rule on the whole gradient, from the shards (`split`:
        see global_square_sum; `extra_sq`: squares of gradients outside the partition,
        MoE experts): scales `shard_grad` in place; returns the coefficient (a 0-d
        array where the shard lives: nothing here waits for a device)."""
        coef = self.arrays.clip_coefficient(
            self.global_square_sum(shard_grad, split) + extra_sq, max_norm
        )
        self.arrays.scale_(shard_grad, coef)
        return coef

    def square_sums(self, shard_grad: np.ndarray, mask: np.ndarray | None) -> tuple[float, float]:
        """(masked, unmasked) sums of squares of the whole (averaged) gradient, from the
        shards, as host floats (the pipeline adds them over its stages)."""
        sums = self.square_sum_array(shard_grad, mask)
        return float(sums[0]), float(sums[1])

    def square_sum_array(self, shard_grad: np.ndarray, mask: np.ndarray | None):
        """[masked, unmasked] sums of squares over the data ranks (one allreduce of two
        numbers), accumulated in float64 where the shard lives (`mask`: an array there;
        a pipeline stage on the device adds them over its stages without a host read)."""
        xp = self.arrays
        sums = xp.zeros(2, "float64")
        if mask is None:
            sums[1] = xp.square_sum(shard_grad)
        else:
            sums[0] = xp.square_sum_where(shard_grad, mask)
            sums[1] = xp.square_sum_where(shard_grad, ~mask)
        if self.n > 1:
            self.comm.allreduce_inplace(sums, "sum", "ZeRO gradient norm")
        return sums

    def shard_mask(self, params: set[int]) -> np.ndarray:
        """True where this rank's shard holds elements of the parameters `params`."""
        flat = np.zeros(self.flat_len, dtype=np.float32)
        for i, view in enumerate(self.views(flat)):
            if i in params:
                view[:] = 1.0
        return self.shard_of(flat) > 0

    def gather_params(self, shard: np.ndarray, flat: np.ndarray) -> None:
        """Every rank's updated pieces into every rank's padded flat parameters."""
        for s in range(len(self.segments)):
            self.gather_segment(s, shard, self.segment_view(flat, s))

    def gather_segment(self, s: int, shard: np.ndarray, target: np.ndarray) -> None:
        """Segment `s` of the parameters (padded length) from every rank's piece."""
        k = self.segments[s].piece(self.n)
        mine = self.shard_view(shard, s)
        if self.n == 1:
            target[:] = mine
            return
        self.comm.allgather_into(
            mine,  # a slice of the 1-D shard: contiguous
            target,
            [k] * self.n,
            f"ZeRO-{self.stage} parameter allgather (segment {s})",
        )
        self._sent += (self.n - 1) * k * 4

    def gather_full(self, shard: np.ndarray, what: str) -> np.ndarray | None:
        """The full padded flat vector of a shard-shaped array on rank 0 (None elsewhere):
        for checkpoints, so they keep the canonical, world-size-free layout."""
        if self.n == 1:
            return self.unshard(shard[None])
        pieces = self.host.gather_array(np.ascontiguousarray(shard, dtype=np.float32), what=what)
        return None if pieces is None else self.unshard(pieces)

    def gather_arrays(self, shard: np.ndarray, shapes: list[tuple], what: str):
        """Every parameter of a shard-shaped array, whole and shaped, on rank 0 (None
        elsewhere): one gather of the shards (ZeRO-3's parameters for a checkpoint)."""
        full = self.gather_full(shard, what)
        if full is None:
            return None
        return [v.reshape(s).copy() for v, s in zip(self.views(full), shapes, strict=True)]

    def unshard(self, pieces: np.ndarray) -> np.ndarray:
        """[N, shard_len] rank shards -> the padded flat vector."""
        flat = np.zeros(self.flat_len, dtype=np.float32)
        for s, seg in enumerate(self.segments):
            k = seg.piece(self.n)
            part = pieces[:, seg.shard_start : seg.shard_start + k]
            self.segment_view(flat, s)[:] = part.reshape(-1)
        return flat

    def largest_segment_bytes(self) -> int:
        """One segment's padded buffer: what stage 2 holds beside its shard while the
        segment's gradients arrive (the stage-1 shard beside the whole gradient)."""
        return (
            max(seg.padded for seg in self.segments) * 4 if self.stage >= 2 else self.shard_len * 4
        )

    def gathered_bytes(self) -> int:
        """Stage 3: the parameter bytes gathered at once, two slots of the largest unit
        (the one running and the one prefetched; backends/torch_zero3.py)."""
        return 2 * max(seg.padded for seg in self.segments) * 4

    def take_sent(self) -> int:
        """Bytes this rank sent since the last call (for `comm_bytes`)."""
        sent, self._sent = self._sent, 0
        return sent

    # --- the memory model ---------------------------------------------------------------
    def expected_bytes(self, slots: int) -> dict[str, float]:
        """The ZeRO paper's per-rank bytes for float32 training: parameters Psi*4 (stage 3:
        Psi*4/N + two slots of the largest unit), optimizer state slots*Psi*4/N,
        gradients Psi*4 (stage 1) or Psi*4/N (stages 2 and 3, + one segment)."""
        psi = sum(self.sizes)
        grads = psi * 4 if self.stage == 1 else self.shard_len * 4
        params = psi * 4 if self.stage < 3 else self.shard_len * 4 + self.gathered_bytes()
        return {
            "zero_model_param_bytes": float(params),
            "zero_model_optimizer_bytes": float(slots * self.shard_len * 4),
            "zero_model_grad_bytes": float(grads),
        }
