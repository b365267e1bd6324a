"""A GPU rank's state copied to host memory while the next step computes.

Why: an async checkpoint of a GPU rank copied its state with pageable copies inside
the save call; each waits for every kernel queued so far and then for the whole copy,
so the GPU idled while the host copied, and again while the host queued the next step.
Here the copies go into pinned buffers on a side stream and the host queues the next
step at once; the checkpoint's background thread waits for them (`ready`) before it
reads, and the compute stream waits for them (`release`) before the update that
changes what they read: an order on the GPU, no host wait.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .torch_steps import host_scalar


class HostMirror:
    """Reused pinned host buffers, one per exported tensor in export order, filled on a
    side stream.

    Use: `with mirror.copying() as (take, scalar):` then `take(tensor)` per tensor (a
    numpy view of its buffer, filled once `ready()` returned) and `scalar(value, dtype)`
    for a one-element number (fused Adam's step count, fp16's loss scale: a 0-d array,
    set by `ready()` where the value is on the GPU; reading it now would wait for the
    queued step); `release()` before anything changes a copied tensor. The buffers are
    written again at the next `copying()`: whoever reads the previous arrays must be
    done by then (the checkpoint session fences the previous save's copy before it
    exports again). A CUDA event is recorded per export.

    Host memory: one pinned copy of the exported state, kept for the job, on the rank
    that writes a gathered checkpoint (rank 0) only (torch's pinned allocator rounds
    each buffer up to a power of two: under 2x the state); the async save's own copy
    of it (checkpoint/staging.py) comes on top. On a CPU device (tests) `take` copies
    at once into plain buffers and `ready`/`release` have nothing to wait for.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._buffers: list[torch.Tensor] = []
        self._done = None  # the event recorded after the last export's copies
        self._scalars: list[tuple[np.ndarray, np.ndarray]] = []  # (0-d out, its copy)
        self.pending = False  # copies queued and the compute stream not yet after them

    @contextmanager
    def copying(self):
        """Queue copies of the tensors given to `take`, behind the work queued so far on
        the compute stream (the last update); the event is recorded on exit."""
        taken: list[torch.Tensor] = []
        scalars: list[tuple[np.ndarray, np.ndarray]] = []
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def take(tensor: torch.Tensor) -> np.ndarray:
            src = tensor.detach()
            buf = self._reusable(len(taken), src)
            taken.append(buf)
            if self.cuda and src.is_cuda:
                with torch.cuda.stream(self.stream):
                    buf.copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # a tensor freed meanwhile keeps its memory
            else:
                buf.copy_(src)
            return buf.numpy()

        def scalar(value, dtype) -> np.ndarray:
            if not (torch.is_tensor(value) and value.is_cuda):
                return host_scalar(value, dtype)
            out = np.zeros((), dtype)  # owns its memory: the save keeps it uncopied
            scalars.append((out, take(value)))
            return out

        try:
            yield take, scalar
        finally:
            self._buffers = taken  # buffers beyond this export's tensors are freed
            self._scalars = scalars
            if self.cuda:  # a blocking event: ready()'s thread sleeps, not spins
                self._done = torch.cuda.Event(blocking=True)
                self._done.record(self.stream)
                self.pending = True

    def _reusable(self, index: int, src: torch.Tensor) -> torch.Tensor:
        """The buffer at `index` if it fits `src`, else a new one (pinned on a GPU rank:
        allocated once, at the first save)."""
        if index < len(self._buffers):
            buf = self._buffers[index]
            if buf.shape == src.shape and buf.dtype == src.dtype:
                return buf
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=self.cuda)

    def ready(self) -> None:
        """Block the calling thread (any thread) until the last export's copies ran."""
        done = self._done
        if done is not None:
            with torch.cuda.device(self.device):  # a new thread's current GPU is GPU 0
                done.synchronize()
        for out, copied in self._scalars:
            out[...] = host_scalar(copied, out.dtype)

    def release(self) -> None:
        """Make the compute stream wait for the last export's copies (call before a
        copied tensor changes); the host goes on. Nothing to do once done."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self.pending = False
