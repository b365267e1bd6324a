"""fp16 / bf16 on the wire over a process group (`train.allreduce: gloo | nccl`).

A process group sums 16-bit numbers itself (NCCL on GPUs, Gloo on CPUs), so no ring is
written here (the MPI engine's is `halfring.py`: MPI has no half-precision sum). As torch
DDP's `fp16_compress_hook` and Horovod's `Compression.fp16` do, each rank divides its
gradient by N in float32, casts it to 16 bits, and the library's allreduce sums the
16-bit numbers (one rounding per addition); the mean is cast back to float32. Dividing
first keeps every partial sum under the largest gradient, so fp16 overflows only where a
gradient itself is above 65,504; magnitudes under 2^-24 x N (fp16's smallest subnormal)
flush to zero. bf16 has float32's range: neither happens.

Cost per rank: the library's allreduce of S/2 bytes (half of float32's), 2(N-1)/N x S/2
with a ring: under S at 1,024 or 4,096 ranks; latency as the dense allreduce's.
"""

from __future__ import annotations

from ..reducer import DenseStats, compressed_stats, flat_buffer

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class HalfMean(DenseStats):
    """The mean of a flat float32 buffer over `comm` (a process-group transport), sent
    in 16 bits; the buffers live where the transport's do (its device)."""

    def __init__(self, comm, sizes: list[int], kind: str, what: str = "gradient allreduce"):
        self.world, self.kind, self.what = comm, kind, what
        self.sizes = [int(n) for n in sizes]
        self.buffer, self.views = flat_buffer(self.sizes, comm)
        self.half = comm.zeros(sum(self.sizes), DTYPES[kind])
        self._sent = 0

    def reduce(self, step: int = 0) -> None:
        n = self.world.size if self.world is not None else 1
        if n == 1:
            self._sent = 0
            return
        self.world.scale_(self.buffer, 1.0 / n)
        self.half[:] = self.buffer  # rounded to 16 bits
        self.world.allreduce_inplace(self.half, "sum", f"{self.what} ({self.kind})")
        self.buffer[:] = self.half
        self._sent = int(2 * (n - 1) * sum(self.sizes) * 2 // n)

    def stats(self) -> dict[str, float]:
        n = self.world.size if self.world is not None else 1
        return compressed_stats(self._sent, n, sum(self.sizes))
