"""The overlapped engine: gradient buckets allreduced while backward is still running.

The backend copies each gradient into its view of one flat float32 buffer the moment
autograd has finished it (torch: post-accumulate-grad hooks) and calls `ready(i)`. The
buffer is cut into buckets of about `bucket_bytes` in reverse registration order (the
order backward produces gradients, as DDP does); a bucket's non-blocking allreduce
starts as soon as its last gradient is in. `finish()` starts whatever is left, waits
for every bucket under the transport's deadline and divides by N.

Written once against the exchange layer's `Transport` (transport.py): over MPI
(`train.allreduce=overlap`: host numpy, `MPI_Iallreduce`, the watchdog's deadline) or
over a torch.distributed group (`train.allreduce=gloo|nccl`: the buffer and its
buckets on the rank's device, as DDP keeps them, and the group's deadline).

Order: MPI needs every rank to start the same collectives in the same order, so bucket b
starts only after buckets 0..b-1 started; a gradient that never arrives (a parameter
unused this step) holds its bucket and the later ones back until `finish()`, which then
starts them in order on every rank alike.

Progress: Open MPI advances a non-blocking collective only inside MPI calls (measured
over the emulated 1 Gbit/s link: an Iallreduce of 5.3 MB left alone for 200 ms had not
moved). Each `ready()` tests the outstanding buckets; between hooks a progress thread
tests them every `poll_s` and sleeps otherwise (no spinning: it blocks on an event when
nothing is outstanding, and MPI calls release the GIL). Gloo and NCCL progress on
their own threads and streams: over a process group `poll_s` is 0 and no thread starts.

Cost: per rank per step the same bytes as one flat ring allreduce (2(N-1)/N of the
gradients) in `ceil(bytes / bucket_bytes)` collectives, whatever N (1,024 or 4,096
ranks: the same bucket count, each bucket's latency term grows as in any ring).
"""

from __future__ import annotations

import threading

import numpy as np

from .reducer import DenseStats, flat_buffer


def bucket_plan(sizes: list[int], bucket_bytes: int, itemsize: int = 4) -> list[list[int]]:
    """Gradient indices per bucket, in reverse registration order; each bucket is a
    contiguous range of the flat buffer (indices consecutive) of >= bucket_bytes, except
    the last."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i] * itemsize
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class OverlapMean(DenseStats):
    """Average a flat float32 buffer over `comm` bucket by bucket, started from hooks.

    Use per step: `ready(i)` for each gradient as it is finished (any order), then
    `finish()`; or `reduce(step)` to do all of it at once after backward (TensorFlow)."""

    def __init__(
        self,
        comm,
        sizes: list[int],
        bucket_bytes: int,
        what: str = "gradient allreduce (bucket)",
        poll_s: float = 0.0005,
    ):
        """comm: a `Transport` (None: one process, nothing to average); the buffer and
        its views are of the transport's array type, allocated by it."""
        self.world = comm
        self.sizes = [int(n) for n in sizes]
        ends = np.cumsum([0, *self.sizes])
        if comm is None:
            self.buffer, self.views = flat_buffer(self.sizes)
        else:
            self.buffer = comm.zeros(int(ends[-1]))
            self.views = [self.buffer[int(a) : int(b)] for a, b in zip(ends, ends[1:])]
        self.what = what
        self.buckets = bucket_plan(self.sizes, int(bucket_bytes))
        # Element range of each bucket in the buffer (its indices are consecutive).
        self.ranges = [(int(ends[min(b)]), int(ends[max(b) + 1])) for b in self.buckets]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self.poll_s = float(poll_s)
        self._left: list[int] = []
        self._next = 0  # the next bucket to start (buckets start in order)
        self._pending = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = None
        self._sent = 0
        self.begin()

    @property
    def distributed(self) -> bool:
        return self.world is not None and self.world.size > 1

    @property
    def started(self) -> int:
        """Buckets started so far this step (all of them once backward has sent every
        gradient: the overlap the hooks achieved)."""
        return self._next

    def begin(self) -> None:
        """Start a step: no gradient is in yet."""
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._sent = 0

    def ready(self, index: int) -> None:
        """Gradient `index` is in its view: start every bucket that is now complete."""
        k = self.bucket_of[index]
        self._left[k] -= 1
        if not self.distributed:
            return
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._start(self._next)
        self._progress()

    def _start(self, k: int) -> None:
        lo, hi = self.ranges[k]
        pending = self.world.start_allreduce_inplace(self.buffer[lo:hi], "sum", self.what)
        n = self.world.size
        self._sent += 2 * (n - 1) * (hi - lo) * 4 // n
        with self._lock:
            self._pending.append(pending)
        self._next = k + 1
        self._ensure_thread()
        self._wake.set()

    def _progress(self) -> None:
        with self._lock:
            for p in self._pending:
                if not p.test():
                    break  # later buckets cannot finish before earlier ones

    def _ensure_thread(self) -> None:
        if self._thread is None and self.poll_s > 0:
            self._thread = threading.Thread(
                target=self._poll, name="hpctrain-bucket-progress", daemon=True
            )
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop:
            self._wake.wait()
            with self._lock:
                busy = any(not p.test() for p in self._pending)
                if not busy:
                    self._wake.clear()
            if busy:
                threading.Event().wait(self.poll_s)

    def finish(self) -> None:
        """Start the buckets still waiting (in order), wait for all, divide by N."""
        if not self.distributed:
            self.begin()
            self._sent = 0
            return
        while self._next < len(self.buckets):
            self._start(self._next)
        with self._lock:  # the progress thread stays out while we wait
            for p in self._pending:
                p.wait()
            self._pending = []
            self._wake.clear()
        self.world.scale_(self.buffer, 1.0 / self.world.size)
        sent = self._sent
        self.begin()
        self._sent = sent

    def reduce(self, step: int = 0) -> None:
        """All gradients are in the buffer already: bucketed allreduce of all of it."""
        self.begin()
        self._next = 0
        if self.distributed:
            for k in range(len(self.buckets)):
                self._start(k)
        self.finish()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
