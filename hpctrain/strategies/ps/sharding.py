"""Which server owns which slice of which parameter: deterministic, byte-balanced.

Every rank computes the same plan from the same inputs (parameter names in canonical
order, shapes, server count, chunk size), so no mapping is ever sent and no salted
`hash()` is involved. A tensor larger than `chunk_bytes` is cut into nearly equal chunks,
so one large matrix cannot make one server the bottleneck. Chunks are placed greedily on
the least-loaded server (ties: lowest index), largest first; after every placement the
spread between the most and least loaded server is at most one chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunk:
    """Elements [start, stop) of the flattened parameter `name`, held by `server` at
    [offset, offset + stop - start) of that server's flat buffer."""

    name: str
    start: int
    stop: int
    server: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class ShardPlan:
    servers: int
    chunks: list[Chunk]  # in canonical (name, start) order
    shapes: dict[str, tuple[int, ...]]

    def server_size(self, server: int) -> int:
        """Float32 elements held by `server`."""
        return sum(c.size for c in self.chunks if c.server == server)

    def for_server(self, server: int) -> list[Chunk]:
        return [c for c in self.chunks if c.server == server]

    def gather(self, server: int, arrays: dict[str, np.ndarray], out: np.ndarray) -> np.ndarray:
        """Copy this server's slices of `arrays` (by name) into its flat buffer `out`."""
        for c in self.for_server(server):
            out[c.offset : c.offset + c.size] = np.ravel(arrays[c.name])[c.start : c.stop]
        return out

    def scatter(self, server: int, flat: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Write a server's flat buffer back into full-size arrays (by name, in place)."""
        for c in self.for_server(server):
            arrays[c.name].reshape(-1)[c.start : c.stop] = flat[c.offset : c.offset + c.size]


def plan_shards(
    shapes: dict[str, tuple[int, ...]], servers: int, chunk_bytes: int, itemsize: int = 4
) -> ShardPlan:
    """Split and place every parameter; `shapes` must be in the same order on every rank."""
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    max_elems = max(1, chunk_bytes // itemsize)
    pieces: list[tuple[str, int, int]] = []
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        parts = max(1, math.ceil(n / max_elems))
        bounds = [n * i // parts for i in range(parts + 1)]  # nearly equal chunks
        pieces += [
            (name, bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]
        ]
    # Largest first (stable: canonical order among equals), then least-loaded server.
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][2] - pieces[i][1]), i))
    load = [0] * servers
    owner = {}
    for i in order:
        s = min(range(servers), key=lambda k: (load[k], k))
        owner[i] = s
        load[s] += pieces[i][2] - pieces[i][1]
    offsets = [0] * servers
    chunks = []
    for i, (name, start, stop) in enumerate(pieces):  # offsets in canonical order
        s = owner[i]
        chunks.append(Chunk(name, start, stop, s, offsets[s]))
        offsets[s] += stop - start
    return ShardPlan(servers, chunks, {k: tuple(v) for k, v in shapes.items()})
