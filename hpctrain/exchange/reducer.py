"""The Reducer interface the backends use, and the dense float32 average.

A reducer owns one flat float32 buffer (`buffer`, with one view per gradient in
`views`); the backend writes the step's gradients into the views, calls
`reduce(step)`, and reads the averages back from the same views. `stats()` says what
the last `reduce` put on the wire (`comm_bytes` per rank, `compression_ratio` against
dense float32), for metrics.jsonl. Reducers with per-rank memory (error-feedback
residuals, PowerSGD's warm-start factors) expose it through `state()`/`load_state()`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..runtime.host_arrays import HostArrays


class Reducer(Protocol):
    buffer: np.ndarray
    views: list[np.ndarray]
    sizes: list[int]

    def reduce(self, step: int) -> None: ...  # average `buffer` over ranks, in place

    def stats(self) -> dict[str, float]: ...  # comm_bytes, compression_ratio of the last reduce

    def state(self) -> dict[str, np.ndarray]: ...  # per-rank memory (empty when none)

    def load_state(self, state: dict[str, np.ndarray]) -> None: ...


def flat_buffer(sizes: list[int], arrays=None) -> tuple[np.ndarray, list[np.ndarray]]:
    """One preallocated float32 buffer and a view per gradient of `sizes` elements,
    host numpy or where `arrays` (a transport's array seam) keeps its buffers."""
    sizes = [int(n) for n in sizes]
    buffer = np.zeros(sum(sizes), np.float32) if arrays is None else arrays.zeros(sum(sizes))
    ends = np.cumsum(sizes)
    return buffer, [buffer[int(e) - n : int(e)] for n, e in zip(sizes, ends, strict=True)]


def compressed_stats(sent: int, n: int, elements: int) -> dict[str, float]:
    """`stats()` of a reducer that sent `sent` bytes for `elements` float32 values over
    n ranks: the ratio is against the dense ring's 2(N-1)/N x 4 bytes per value."""
    dense = 2 * (n - 1) * elements * 4 / max(n, 1)
    ratio = dense / sent if sent else 1.0
    return {"comm_bytes": float(sent), "compression_ratio": float(ratio)}


class DenseStats:
    """What every reducer without per-rank memory shares: `_sent` bytes of dense
    float32 (ratio 1), nothing to checkpoint."""

    _sent = 0

    def stats(self) -> dict[str, float]:
        return {"comm_bytes": float(self._sent), "compression_ratio": 1.0}

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        return None


class DenseMean(DenseStats):
    """Average the flat float32 buffer with one in-place `MPI_Allreduce`.

    One preallocated buffer: no per-step allocation, one message per step. Ring
    allreduce sends 2(N-1)/N of the buffer per rank, whatever N (1,024 or 4,096 ranks:
    still < 2x the buffer), so the happy path does not grow with the job.
    """

    def __init__(self, comm, sizes: list[int], what: str = "gradient allreduce", arrays=None):
        """comm: a `Transport` (None: one process); `arrays`: where the buffer lives
        (the transport's array seam; None: host numpy)."""
        self.world = comm
        self.sizes = [int(n) for n in sizes]
        self.buffer, self.views = flat_buffer(self.sizes, arrays)
        self.arrays = arrays if arrays is not None else HostArrays()
        self.what = what
        self._sent = 0

    def reduce(self, step: int = 0) -> None:
        if self.world is None or self.world.size == 1:
            self._sent = 0
            return
        self.world.allreduce_inplace(self.buffer, "sum", self.what)
        self.arrays.scale_(self.buffer, 1.0 / self.world.size)
        n = self.world.size
        self._sent = int(2 * (n - 1) * self.buffer.nbytes // n)


def make_reducer(
    cfg, comm, shapes: list[tuple], what: str = "gradient allreduce", engine: str = "mpi"
) -> Reducer:
    """The reducer `cfg` asks for, over `comm`, for gradients of `shapes`.

    `cfg` is the validated Config (train.compression and the `compression` section).
    Shapes, not only sizes: PowerSGD works on matrices. Compression runs on the `mpi`
    engine (host numpy) and on the process-group engines (`gloo`, `nccl`: `comm` is then
    the process group's transport and every buffer lives on its device; 16-bit there is
    the library's own allreduce, not the MPI ring). Other
    engines (Horovod compresses on its own; the overlapped engine sends dense buckets)
    get the dense mean.
    """
    sizes = [int(np.prod(s)) for s in shapes]
    method = cfg.train["compression"]
    if engine in ("gloo", "nccl") and method != "none":
        from .compression import build

        opts = {**cfg["compression"], "seed": cfg.train["seed"]}
        return build(method, comm, shapes, opts, what, ring=False)
    if engine != "mpi":
        return DenseMean(comm, sizes, what)
    if cfg.train["hierarchical"]:
        from .hierarchical import HierarchicalMean

        return HierarchicalMean(comm, sizes, what)
    if method == "none":
        return DenseMean(comm, sizes, what)
    from .compression import build

    opts = {**cfg["compression"], "seed": cfg.train["seed"]}
    return build(method, comm, shapes, opts, what)
