"""Point-to-point traffic between neighbouring stages: activations forward, gradients back.

Shapes and dtypes are agreed once when the pipeline is built (a micro-batch always has
`train.batch_size` samples), so every message is a bare contiguous buffer: no pickling,
no per-step metadata. The buffers and the messages are the pipe axis's transports'
(exchange/transport.py): numpy over MPI `Isend`/`Irecv` on the `mpi` engine, torch
tensors over the process groups' `isend`/`irecv` on `gloo` (CPU ranks, and GPU ranks
sharing a GPU, whose messages the transport stages through the host) and `nccl` (GPU
ranks, on the device).

Two orders keep every engine deadlock-free. Where a wait blocks the host (MPI, Gloo) a
receive is posted one micro-batch ahead, so the next input arrives while this one is
computed. NCCL matches a pair's calls by issue order on its group's stream and its
waits only order the device's streams (the host never blocks, so posting ahead gains
nothing there); a receive posted ahead of a send would queue that send behind it. So on
NCCL (`post_ahead=False`) each receive is issued where its data is used, and gradients
travel on a second group over the same ranks (`back`): each group's stream then carries
one direction, in micro-batch order at both ends, as every schedule sends
(tests/test_pipeline_stream_order.py checks this against NCCL's stream semantics for
both schedules, and that one group with receives ahead would deadlock).

A received buffer is handed to the caller and is not reused until the caller releases
it: a stage input stays valid until its backward pass (reusing one receive buffer for
the next micro-batch is exactly the "pipeline overwrites its own inputs" bug). Sent
arrays are kept alive until the transport reports the send complete.

Every wait has a deadline (`runtime.collective_timeout`; NCCL's is its group timeout):
a neighbour that stopped or hangs ends the job with a message naming its stage and
world rank.
"""

from __future__ import annotations

import math
import time

import numpy as np

ACT, GRAD = 0, 1
CONNECT_TAG = 32000  # connect()'s messages: under MPI's least tag bound (32767)


class StageTransport:
    """One stage's links to the previous and the next stage of its pipeline."""

    def __init__(
        self, pipe, stage: int, stages: int, in_shape, out_shape, dtype=np.float32,
        peer_rank=lambda s: s, back=None, post_ahead: bool = True,
    ):  # fmt: skip
        """pipe: the transport of the grid's `pipe` axis (a guarded communicator, or a
        process group's), which carries the activations; back: the gradients' (a second
        group over the same ranks; default `pipe`); post_ahead: post each receive one
        micro-batch early (not on NCCL, above); peer_rank(stage) gives a stage's world
        rank, for messages."""
        self.pipe = pipe
        self.back = pipe if back is None else back
        self.post_ahead = post_ahead
        self.stage = stage
        self.peer_rank = peer_rank
        self.prev = stage - 1 if stage > 0 else None
        self.next = stage + 1 if stage < stages - 1 else None
        self.in_shape = None if in_shape is None else tuple(in_shape)
        self.out_shape = None if out_shape is None else tuple(out_shape)
        self.dtype = np.dtype(dtype)
        self._free: list = []  # activation buffers ready for the next receive
        self._posted: dict[tuple[int, int], tuple[object, object]] = {}
        self._sends: list[tuple[object, object, int]] = []  # (pending, buffer, stage)
        self.wait_seconds = 0.0  # time blocked waiting for a neighbour
        self.bytes_sent = 0

    def _name(self, stage: int) -> str:
        return f"stage {stage} (rank {self.peer_rank(stage)})"

    # --- buffers -------------------------------------------------------------------
    def _buffer(self, kind: int):
        if kind == ACT and self._free:
            return self._free.pop()
        # Gradient buffers are never pooled: a framework may keep the upstream gradient
        # (e.g. as the gradient of a residual input) after the backward returns.
        shape = self.in_shape if kind == ACT else self.out_shape
        return self._link(kind).zeros(math.prod(shape), self.dtype.name).reshape(shape)

    def release(self, buf) -> None:
        """Give a received activation buffer back after its micro-batch's backward.

        A buffer an unfinished send still reads (a stage that only reshapes sends a view
        of its input) is dropped instead of pooled; so is every device buffer (a
        framework may hold it in its graph; the device's allocator reuses the memory).
        """
        if not isinstance(buf, np.ndarray) or buf.shape != self.in_shape:
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
        what = "activation" if kind == ACT else "gradient"
        pending = self._link(kind).start_recv(
            buf.reshape(-1),
            src,
            2 * micro + kind,
            f"pipeline {self._name(self.stage)} waiting for the {what} of micro-batch {micro}",
            self._name(src),
        )
        self._posted[(kind, micro)] = (pending, buf)

    def _link(self, kind: int):
        return self.pipe if kind == ACT else self.back

    def _take(self, kind: int, micro: int):
        self._post(kind, micro)
        pending, buf = self._posted.pop((kind, micro))
        t0 = time.perf_counter()
        pending.wait()
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def post_activation(self, micro: int) -> None:
        """Post the receive of `micro`'s input now (where posting ahead is on)."""
        if self.prev is not None and self.post_ahead:
            self._post(ACT, micro)

    def post_gradient(self, micro: int) -> None:
        """Post the receive of `micro`'s output gradient now (where posting ahead is on)."""
        if self.next is not None and self.post_ahead:
            self._post(GRAD, micro)

    def activation(self, micro: int):
        """Micro-batch `micro`'s input from the previous stage (caller releases it)."""
        return self._take(ACT, micro)

    def gradient(self, micro: int):
        """Loss gradient w.r.t. this stage's output for `micro` (caller releases it)."""
        return self._take(GRAD, micro)

    # --- before the first step -----------------------------------------------------
    def connect(self) -> None:
        """Exchange one element with each neighbour on each link, before any step.

        NCCL creates a pair's communicator at the pair's first call, and that blocks the
        host until the peer calls too. Inside a step the host may be there while one of
        its sends still runs on the device, waiting for a receive the peer's host posts
        only after its own creation: a cycle if creating needs the device. Here nothing
        else is in flight. The order is deadlock-free on every engine: on each link in
        turn, the call with the previous stage first, then the next stage's, each
        waited for."""
        ends = (
            (ACT, self.prev, "start_recv"),
            (ACT, self.next, "start_send"),
            (GRAD, self.prev, "start_send"),
            (GRAD, self.next, "start_recv"),
        )
        for kind, peer, call in ends:
            if peer is None:
                continue
            link = self._link(kind)
            what = f"pipeline {self._name(self.stage)} connecting to {self._name(peer)}"
            one = link.zeros(1, self.dtype.name)
            t0 = time.perf_counter()
            getattr(link, call)(one, peer, CONNECT_TAG, what, self._name(peer)).wait()
            self.wait_seconds += time.perf_counter() - t0

    # --- sends ---------------------------------------------------------------------
    def _send(self, kind: int, arr, dest: int, tag: int, shape: tuple) -> None:
        link = self._link(kind)
        if isinstance(arr, np.ndarray):  # a host array from the stage: the transport's
            arr = link.from_host(np.ascontiguousarray(arr))  # (no copy on CPUs)
        dtype = str(arr.dtype).removeprefix("torch.")
        if tuple(arr.shape) != shape or dtype != self.dtype.name:
            raise RuntimeError(
                f"pipeline message {dtype}{tuple(arr.shape)} differs from the agreed "
                f"{self.dtype.name}{shape}"
            )
        what = f"pipeline {self._name(self.stage)} sending to {self._name(dest)}"
        pending = link.start_send(arr.reshape(-1), dest, tag, what, self._name(dest))
        self._sends.append((pending, arr, dest))
        self.bytes_sent += math.prod(shape) * self.dtype.itemsize
        self.progress()

    def send_activation(self, micro: int, arr) -> None:
        self._send(ACT, arr, self.next, 2 * micro + ACT, self.out_shape)

    def send_gradient(self, micro: int, arr) -> None:
        self._send(GRAD, arr, self.prev, 2 * micro + GRAD, self.in_shape)

    def progress(self) -> None:
        """Let the transport advance outstanding sends and forget the finished ones."""
        if self._sends:
            self._sends = [s for s in self._sends if not s[0].test()]

    def flush(self) -> None:
        """Wait until every send of this step has left (end of step)."""
        if self._sends:
            t0 = time.perf_counter()
            for pending, _, _ in self._sends:
                pending.wait()
            self.wait_seconds += time.perf_counter() - t0
            self._sends = []
