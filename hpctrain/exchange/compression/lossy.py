"""Lossy gradient compressors with error feedback: top-k, random-k, 8-bit, PowerSGD.

Each works on the flat float32 gradient buffer of one rank, written once over the
transport's array seam (exchange/transport.py): host numpy over MPI, or torch tensors
on the rank's device over a process group (Gloo on CPU ranks, NCCL on GPU ranks), so a
GPU rank compresses, exchanges and decompresses without a copy to the host or a host
wait per step (only random-k's k indices, drawn on the host from the shared seed,
cross to the device, without waiting). With error feedback (on by
default) what a step did not send is kept in a per-rank residual and added to the next
step's gradient, so nothing is lost, only delayed (Stich et al.; Karimireddy et al.);
without it top-k drops most of every gradient for good. The first
`compression.warmup_steps` steps are sent dense.

Costs per rank at N ranks, S float32 bytes of gradient, ratio rho:
- topk: Allgather of k = max(1, int(n rho)) (index, value) pairs: receives (N-1) 8k bytes;
  at rho = 0.01 that is 0.02 (N-1) S: below the dense ring's 2S up to N ~ 100, so at
  1,024 or 4,096 ranks top-k loses to dense unless rho shrinks with N (said in the docs).
- randomk: the indices come from a seed every rank shares, so only the k values travel,
  in one Allreduce: 2 (N-1)/N 4k bytes, which does not grow with N.
- int8: Allgather of n bytes + 8 (min, scale): receives (N-1)(S/4) bytes: wins over the
  dense ring (2S) only below N = 9; at 1,024 ranks it sends 128x more than dense.
- powersgd: two Allreduces of the low-rank factors, r (rows + cols) floats per matrix,
  plus the vectors dense: independent of N.
"""

from __future__ import annotations

import numpy as np

from ...runtime.host_arrays import HostArrays
from ..reducer import DenseMean, compressed_stats


class _Lossy:
    """Shared parts: the buffer, error feedback, dense warm-up, byte counting."""

    def __init__(self, comm, shapes, opts: dict, what: str):
        self.world = comm
        self.xp = comm if comm is not None else HostArrays()  # the array seam
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dense = DenseMean(comm, self.sizes, what, arrays=self.xp)  # warm-up steps
        self.buffer, self.views = self.dense.buffer, self.dense.views
        self.opts, self.what = opts, what
        self.feedback = bool(opts["error_feedback"])
        self.residual = self.xp.zeros(self.length) if self.feedback else None
        self._sent = 0

    @property
    def n(self) -> int:
        return self.world.size if self.world is not None else 1

    @property
    def length(self) -> int:
        return sum(self.sizes)

    def reduce(self, step: int = 0) -> None:
        if self.n == 1:
            self._sent = 0
            return
        if step < self.opts["warmup_steps"]:
            self.dense.reduce(step)
            self._sent = self.dense._sent
            return
        g = self.buffer
        if self.feedback:
            g += self.residual  # what earlier steps did not send
        local = self.xp.copy(g) if self.feedback else None
        self._sent = 0
        # `g` becomes the average; `sent` is what this rank's gradient counted as.
        sent = self._exchange(g, step)
        if self.feedback:  # in place: no temporary of the whole gradient
            local -= sent
            self.residual = local

    def stats(self) -> dict[str, float]:
        return compressed_stats(self._sent, self.n, self.length)

    def state(self) -> dict[str, np.ndarray]:
        return {"residual": self.xp.to_host(self.residual)} if self.feedback else {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        residual = state.get("residual")
        if self.feedback and residual is not None and residual.size == self.length:
            self.residual[:] = self.xp.from_host(residual.reshape(-1).astype(np.float32))

    def _k(self) -> int:
        return max(1, int(self.length * float(self.opts["ratio"])))

    def _rows(self, mine, what: str) -> list:
        """Every rank's equally long `mine`, one row per rank in rank order (Allgather)."""
        m = int(mine.shape[0])
        everyone = self.xp.zeros(m * self.n, str(mine.dtype).removeprefix("torch."))
        self.world.allgather_into(mine, everyone, [m] * self.n, what)
        self._sent += m * mine.itemsize * (self.n - 1)  # each rank's row to N-1 ranks
        return [everyone[r * m : (r + 1) * m] for r in range(self.n)]


class TopK(_Lossy):
    """The k largest-magnitude entries of each rank, summed densely on every rank."""

    def _exchange(self, g, step: int):
        xp, k = self.xp, self._k()
        idx = xp.top_k_indices(g, k)
        vals = xp.take(g, idx)
        # indices travel bit for bit beside the values
        pairs = xp.concat([xp.bitcast(idx, "float32"), vals])
        rows = self._rows(pairs, f"{self.what} (top-k)")
        sent = xp.zeros(self.length)
        xp.put_(sent, idx, vals)
        g[:] = 0.0
        for row in rows:
            xp.index_add_(g, xp.bitcast(row[:k], "int32"), row[k:])
        xp.scale_(g, 1.0 / self.n)
        return sent


class RandomK(_Lossy):
    """k entries drawn from a seed all ranks share (so only values travel), one Allreduce.
    Without error feedback they are scaled by n/k, which keeps the estimate unbiased."""

    def _exchange(self, g, step: int):
        xp, k = self.xp, self._k()
        rng = np.random.default_rng((int(self.opts.get("seed", 0)), int(step)))
        idx = xp.from_host(np.sort(rng.choice(self.length, size=k, replace=False)))
        vals = xp.take(g, idx)
        sent = xp.zeros(self.length)
        xp.put_(sent, idx, vals)
        self.world.allreduce_inplace(vals, "sum", f"{self.what} (random-k)")
        self._sent += 2 * (self.n - 1) * k * 4 // self.n
        scale = 1.0 if self.feedback else self.length / k
        g[:] = 0.0
        xp.scale_(vals, scale / self.n)
        xp.put_(g, idx, vals)
        return sent


class Int8(_Lossy):
    """Min-max 8-bit quantization (256 levels between this rank's min and max, rounded
    to nearest), allgathered and dequantized in float32. The minimum and the step stay
    0-d arrays (on a GPU, no wait for the host)."""

    def _exchange(self, g, step: int):
        xp = self.xp
        lo = g.min()
        span = xp.astype(g.max(), "float64") - xp.astype(lo, "float64")
        scale = xp.astype(span / 255.0 + (span == 0), "float32")  # 1 where max == min
        q = xp.astype(xp.round_clip((g - lo) / scale, 0, 255), "uint8")
        header = xp.bitcast(xp.concat([xp.astype(lo, "float32"), scale]), "uint8")
        rows = self._rows(xp.concat([header, q]), f"{self.what} (int8)")
        sent = xp.astype(q, "float32") * scale + lo
        g[:] = 0.0
        for row in rows:
            lo_scale = xp.bitcast(row[:8], "float32")
            g += xp.astype(row[8:], "float32") * lo_scale[1] + lo_scale[0]
        xp.scale_(g, 1.0 / self.n)
        return sent


class PowerSGD(_Lossy):
    """Rank-r PowerSGD (Vogels et al. 2019) with warm start: per matrix M (first dim x the
    rest), P = M Q, mean over ranks, orthonormalize, Q = M^T P, mean over ranks; the
    average is approximated by P Q^T. Vectors (biases) go dense in the same messages."""

    def __init__(self, comm, shapes, opts: dict, what: str):
        super().__init__(comm, shapes, opts, what)
        r = int(opts["rank"])
        offsets = np.cumsum([0, *self.sizes])
        self.mats, self.vecs = [], []
        rng = np.random.default_rng(int(opts.get("seed", 0)))  # same Q on every rank
        for shape, lo, hi in zip(self.shapes, offsets[:-1], offsets[1:], strict=True):
            if len(shape) >= 2 and min(shape[0], int(np.prod(shape[1:]))) > r:
                rows, cols = shape[0], int(np.prod(shape[1:]))
                q = self.xp.from_host(rng.standard_normal((cols, r)).astype(np.float32))
                self.mats.append((int(lo), rows, cols, q))
            else:
                self.vecs.append((int(lo), int(hi)))

    def _exchange(self, g, step: int):
        xp, r, none = self.xp, int(self.opts["rank"]), self.xp.zeros(0)
        local = [
            xp.copy(g[lo : lo + rows * cols].reshape(rows, cols)) for lo, rows, cols, _ in self.mats
        ]
        vec = xp.concat([g[lo:hi] for lo, hi in self.vecs] + [none])
        first = xp.concat([m @ q for m, (*_, q) in zip(local, self.mats, strict=True)] + [vec])
        self._mean(first, "P and vectors")
        ps, at = [], 0
        for _, rows, _, _ in self.mats:
            ps.append(xp.qr(first[at : at + rows * r].reshape(rows, r)))  # orthonormal
            at += rows * r
        second = xp.concat([m.T @ p for m, p in zip(local, ps, strict=True)] + [none])
        self._mean(second, "Q")
        sent = xp.copy(g)  # vectors count exactly (no residual); matrices as approximated
        at_q = 0
        for i, (lo, rows, cols, _) in enumerate(self.mats):
            q_new = xp.copy(second[at_q : at_q + cols * r].reshape(cols, r))
            at_q += cols * r
            approx = (ps[i] @ q_new.T).reshape(-1)
            g[lo : lo + rows * cols] = approx
            # PowerSGD's error feedback: this rank's gradient minus the approximation of
            # the average that every rank applies.
            sent[lo : lo + rows * cols] = approx
            self.mats[i] = (lo, rows, cols, q_new)  # warm start for the next step
        for lo, hi in self.vecs:
            g[lo:hi] = first[at : at + hi - lo]
            at += hi - lo
        return sent

    def state(self) -> dict[str, np.ndarray]:
        """The residual and the warm-start factors Q (equal on every rank)."""
        out = super().state()
        if self.mats:
            out["powersgd.q"] = self.xp.to_host(self.xp.concat([q for *_, q in self.mats]))
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        super().load_state(state)
        q = state.get("powersgd.q")
        sizes = [cols * q_.shape[1] for _, _, cols, q_ in self.mats]
        if q is None or q.size != sum(sizes):  # another rank setting: start Q afresh
            return
        at = 0
        for i, (lo, rows, cols, old) in enumerate(self.mats):
            piece = q[at : at + cols * old.shape[1]].reshape(tuple(old.shape))
            self.mats[i] = (lo, rows, cols, self.xp.from_host(piece.astype(np.float32)))
            at += cols * old.shape[1]

    def _mean(self, buf, part: str) -> None:
        self.world.allreduce_inplace(buf, "sum", f"{self.what} (PowerSGD {part})")
        self.xp.scale_(buf, 1.0 / self.n)
        self._sent += 2 * (self.n - 1) * int(buf.shape[0]) * 4 // self.n
