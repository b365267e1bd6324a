"""Host buffers an asynchronous save copies the caller's arrays into, kept between saves.

The copy is all an async save blocks training for. Into fresh memory it also pays for
the kernel faulting in and zeroing every page; into the previous save's buffers it is
the copy alone, and numpy releases the GIL while copying, so large arrays are split
over threads. The price is one copy of the state held in host memory between saves,
as torch.distributed.checkpoint's cached staging and DeepSpeed's pinned buffers do.
Figures: docs/checkpoints.md (Cost).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_CHUNK = 4 << 20  # bytes: smaller pieces cost more in thread hand-offs than they save


def copy_threads() -> int:
    """The cores this process may run on (at most 8: memory bandwidth, not cores, limits)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Staging:
    """Reusable destination buffers, one per dataset path, and a threaded copy into them.

    A buffer is reused while the path keeps its shape and dtype. The caller must not
    stage again while the previous snapshot is still being written (the Checkpointer
    waits for its background write before it saves again).
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads or copy_threads()
        self._buffers: dict[str, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, items: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """Private copies of `items` ((path, array) pairs), in their order."""
        kept, copies, jobs = {}, [], []
        for path, arr in items:
            buf = self._buffers.get(path)
            if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
                buf = np.empty(arr.shape, arr.dtype)
            kept[path] = buf
            copies.append(buf)
            jobs.extend(_pieces(buf, arr))
        self._buffers = kept  # buffers of paths no longer saved are freed
        batches = list(_batches(jobs))
        if self.threads == 1 or len(batches) == 1:
            for batch in batches:
                _copy(batch)
        else:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-stage") as pool:
                list(pool.map(_copy, batches))
        return copies


def _copy(batch: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in batch:
        np.copyto(dst, src)


def _pieces(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(destination, source) pairs: a large contiguous array in chunks, else whole."""
    if src.nbytes <= _CHUNK or not src.flags.c_contiguous:
        return [(dst, src)]
    flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
    step = max(1, _CHUNK // src.itemsize)
    return [(flat_dst[i : i + step], flat_src[i : i + step]) for i in range(0, src.size, step)]


def _batches(jobs):
    """Pairs grouped into hand-offs of about one chunk each (many small arrays together)."""
    batch, size = [], 0
    for dst, src in jobs:
        batch.append((dst, src))
        size += src.nbytes
        if size >= _CHUNK:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
