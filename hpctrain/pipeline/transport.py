"""Point-to-point traffic between neighbouring stages: activations forward, gradients back.

Shapes and dtypes are agreed once when the pipeline is built (a micro-batch always has
`train.batch_size` samples), so every message is a bare contiguous numpy buffer moved
with `Isend`/`Irecv`: no pickling, no per-step metadata. A receive is posted one
micro-batch ahead, so the next input arrives while this one is computed. A received
buffer is handed to the caller and is not reused until the caller releases it: a stage
input stays valid until its backward pass (reusing one receive buffer for the next
micro-batch is exactly the "pipeline overwrites its own inputs" bug). Sent arrays are
kept alive until MPI reports the send complete.

Every wait has a deadline (`runtime.collective_timeout`, runtime/p2p.py): a neighbour
that stopped or hangs ends the job with a message naming its stage and world rank.
"""

from __future__ import annotations

import time

import numpy as np

from ..runtime import p2p

ACT, GRAD = 0, 1


class StageTransport:
    """One stage's links to the previous and the next stage of its pipeline."""

    def __init__(
        self, pipe, stage: int, stages: int, in_shape, out_shape, dtype=np.float32,
        peer_rank=lambda s: s,
    ):  # fmt: skip
        """pipe: the grid's `pipe` axis (a guarded communicator); peer_rank(stage) gives
        a stage's world rank, for messages."""
        self.MPI = pipe.MPI
        self.pipe = pipe
        self.comm = pipe.comm
        self.stage = stage
        self.peer_rank = peer_rank
        self.prev = stage - 1 if stage > 0 else None
        self.next = stage + 1 if stage < stages - 1 else None
        self.in_shape = None if in_shape is None else tuple(in_shape)
        self.out_shape = None if out_shape is None else tuple(out_shape)
        self.dtype = np.dtype(dtype)
        self._free: list[np.ndarray] = []  # activation buffers ready for the next receive
        self._posted: dict[tuple[int, int], tuple[object, np.ndarray]] = {}
        self._sends: list[tuple[object, np.ndarray, int]] = []  # (request, buffer, stage)
        self.wait_seconds = 0.0  # time blocked waiting for a neighbour
        self.bytes_sent = 0

    # --- buffers -------------------------------------------------------------------
    def _buffer(self, kind: int) -> np.ndarray:
        if kind == ACT and self._free:
            return self._free.pop()
        # Gradient buffers are never pooled: a framework may keep the upstream gradient
        # (e.g. as the gradient of a residual input) after the backward returns.
        return np.empty(self.in_shape if kind == ACT else self.out_shape, dtype=self.dtype)

    def release(self, buf: np.ndarray | None) -> None:
        """Give a received activation buffer back after its micro-batch's backward.

        A buffer an unfinished send still reads (a stage that only reshapes sends a view
        of its input) is dropped instead of pooled.
        """
        if buf is None or buf.shape != self.in_shape:
            return
        if any(np.shares_memory(buf, arr) for _, arr, _ in self._sends):
            return
        self._free.append(buf)

    # --- receives ------------------------------------------------------------------
    def _post(self, kind: int, micro: int) -> None:
        if (kind, micro) in self._posted:
            return
        src = self.prev if kind == ACT else self.next
        buf = self._buffer(kind)
        req = self.comm.Irecv([buf, self.MPI.FLOAT], source=src, tag=2 * micro + kind)
        self._posted[(kind, micro)] = (req, buf)

    def _take(self, kind: int, micro: int) -> np.ndarray:
        self._post(kind, micro)
        req, buf = self._posted.pop((kind, micro))
        t0 = time.perf_counter()
        peer = self.prev if kind == ACT else self.next
        what = "activation" if kind == ACT else "gradient"
        p2p.wait_or_abort(
            self.pipe,
            [req],
            f"pipeline stage {self.stage} (rank {self.peer_rank(self.stage)}) waiting for the "
            f"{what} of micro-batch {micro}",
            f"stage {peer} (rank {self.peer_rank(peer)})",
        )
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def post_activation(self, micro: int) -> None:
        if self.prev is not None:
            self._post(ACT, micro)

    def post_gradient(self, micro: int) -> None:
        if self.next is not None:
            self._post(GRAD, micro)

    def activation(self, micro: int) -> np.ndarray:
        """Micro-batch `micro`'s input from the previous stage (caller releases it)."""
        return self._take(ACT, micro)

    def gradient(self, micro: int) -> np.ndarray:
        """Loss gradient w.r.t. this stage's output for `micro` (caller releases it)."""
        return self._take(GRAD, micro)

    # --- sends ---------------------------------------------------------------------
    def _send(self, arr: np.ndarray, dest: int, tag: int, shape: tuple) -> None:
        if arr.shape != shape or arr.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline message {arr.dtype}{arr.shape} differs from the agreed "
                f"{self.dtype}{shape}"
            )
        arr = np.ascontiguousarray(arr)
        request = self.comm.Isend([arr, self.MPI.FLOAT], dest=dest, tag=tag)
        self._sends.append((request, arr, dest))
        self.bytes_sent += arr.nbytes
        self.progress()

    def send_activation(self, micro: int, arr: np.ndarray) -> None:
        self._send(arr, self.next, 2 * micro + ACT, self.out_shape)

    def send_gradient(self, micro: int, arr: np.ndarray) -> None:
        self._send(arr, self.prev, 2 * micro + GRAD, self.in_shape)

    def progress(self) -> None:
        """Let MPI advance outstanding sends and forget the finished ones."""
        if self._sends:
            done = self.MPI.Request.Testsome([r for r, _, _ in self._sends])
            if done:
                keep = set(range(len(self._sends))) - set(done)
                self._sends = [self._sends[i] for i in sorted(keep)]

    def flush(self) -> None:
        """Wait until every send of this step has left (end of step)."""
        if self._sends:
            t0 = time.perf_counter()
            to = sorted({dest for _, _, dest in self._sends})  # the stages not yet taking
            p2p.wait_or_abort(
                self.pipe,
                [r for r, _, _ in self._sends],
                f"pipeline stage {self.stage} (rank {self.peer_rank(self.stage)}) sending",
                " or ".join(f"stage {s} (rank {self.peer_rank(s)})" for s in to),
            )
            self.wait_seconds += time.perf_counter() - t0
            self._sends = []
