"""One copy per node of data every rank only reads: an MPI shared-memory window per node
(MPI_Win_allocate_shared over the node's ranks), filled by the node's first rank and
mapped by the others.

Why: held privately, such data (the training split in memory, `data.in_memory_mb`)
costs a node local_size x S of memory and the filesystem N x S of reads at start. Here
it costs S per node and nodes x S of reads: at 8 ranks a node and S = 256 MiB, 1,024
ranks read 32 GiB instead of 256 GiB and 4,096 ranks 128 GiB instead of 1 TiB, and
each node holds 256 MiB instead of 2 GiB.

Cost at scale: one split of the group by node (collective, once per group and process),
one window over each node (local to the node), a fence on the node, and two allreduces
of one integer over the group (the agreement on errors, the count of copies for the
run's log: log2 N steps each, 10 at 1,024 ranks and 12 at 4,096). Every wait is under
the group's watchdog deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import DataError

ALIGN = 64  # bytes: each array starts on a cache line


def _layout(specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[dict, int]:
    offsets, total = {}, 0
    for name, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        offsets[name] = (total, nbytes)
        total += -(-nbytes // ALIGN) * ALIGN
    return offsets, total


class NodeShared:
    """Arrays in one shared-memory window per node, read-only once filled.

    group: a GuardedComm of the ranks that read the data (all of them call this
    together). fill(arrays): writes every array, on the node's first rank only; an
    exception there becomes a DataError on every rank of the group. `free()` is
    collective over the node's ranks of the group; a window never freed ends with its
    process (MPI_Finalize).
    """

    def __init__(
        self,
        group,
        specs: dict[str, tuple[tuple[int, ...], np.dtype]],
        fill: Callable[[dict[str, np.ndarray]], None],
        what: str,
    ):
        node = group.node_split()
        offsets, total = _layout(specs)
        self._node, self._win = node, None
        self.writer = node.rank == 0
        with node.watchdog.guard(f"allocate shared memory for {what}"):
            self._win = node.MPI.Win.Allocate_shared(
                max(total, 1) if self.writer else 0, 1, comm=node.comm
            )
        buf, _ = self._win.Shared_query(0)
        memory = np.frombuffer(buf, dtype=np.uint8, count=total)
        self.arrays = {
            name: memory[off : off + nbytes].view(specs[name][1]).reshape(specs[name][0])
            for name, (off, nbytes) in offsets.items()
        }
        error = None
        if self.writer:
            try:
                fill(self.arrays)
            except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
                error = f"{what}: {type(exc).__name__}: {exc}"
        with node.watchdog.guard(f"wait for the node's copy of {what}"):
            self._win.Fence()  # the writer's stores are visible to the node's ranks
        try:
            group.agree(error, error_type=DataError)
        except DataError:
            self.free()
            raise
        for array in self.arrays.values():
            array.flags.writeable = False
        self.nbytes = total
        # how many copies the group holds (one per node): for the run's log
        self.copies = int(group.allreduce_array([int(self.writer)], what="count node copies")[0])

    def free(self) -> None:
        """Release the window (collective over the node's ranks of the group)."""
        if self._win is not None:
            self.arrays = {}
            with self._node.watchdog.guard("free a shared-memory window"):
                self._win.Free()
            self._win = None
