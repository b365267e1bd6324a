"""Sharded, shuffled, prefetched batches from an HDF5 dataset.

Sharding rule (documented in docs/training.md): each epoch, one permutation of the training
set is drawn from (seed, epoch), identical on every rank. Optimizer step s consumes
the next `grad_accum x batch_size x world_size` samples of it; micro-batch m of rank r
is the slice starting at offset + (m x world_size + r) x batch_size. So np=2 with batch
b reads exactly the samples np=1 reads with batch 2b. The tail that does not fill a
global batch is skipped for that epoch (a different tail each epoch). The position is
kept in samples, so a run resumed at another world size continues where it stopped.

Validation is split into contiguous blocks, one per rank, covering every sample
exactly once; the trainer sums loss, correct and counts over ranks.

A training split of at most `data.in_memory_mb` (x and y together) is read whole once,
with one sequential read, by one rank per node into a shared-memory window the node's
ranks map (runtime/node_shared.py; one copy per node, not per rank), and each batch
is then a numpy index of it: h5py's row
selection costs ~15 us per row (2.3 ms for a batch of 128 rows of 32 floats and
their labels, on the background thread of a rank that shares its core with it), and
it made the demo's steps at np=2 2-3x slower than the model's own compute. A larger
split is read row by row: each rank reads only the rows it needs (sorted fancy
indexing, then reordered), never the whole file. Either way a background thread reads
the next batches while the current trains. Which rows make a batch does not depend on
the path, so both give the same batches, bit for bit.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from functools import partial

import h5py
import numpy as np

from ..errors import DataError
from ..models.zoo import InputSpec
from ..runtime.node_shared import NodeShared
from .dataset import DatasetInfo

__all__ = ["BenchmarkData", "DatasetInfo", "ShardedTrainData", "epoch_permutation", "iterate_val"]


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The same permutation on every rank: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _read_rows(ds: h5py.Dataset, rows: np.ndarray) -> np.ndarray:
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    out = np.empty((len(rows), *ds.shape[1:]), dtype=ds.dtype)
    if len(rows) == 0:
        return out
    if len(np.unique(sorted_rows)) == len(sorted_rows):
        out[order] = ds[sorted_rows]
    else:  # h5py refuses repeated indices; never happens with a permutation
        for i, r in enumerate(rows):
            out[i] = ds[int(r)]
    return out


def batch_problem(info, size: int, batch: int, accum: int, accum_key: str) -> str | None:
    """Why the training split cannot make one step, or None. The same on every rank
    (the strategy agrees it before any rank builds its data: an error raised in each
    rank on its own ended the job rank by rank, exit 3, which elastic restarts)."""
    global_batch = batch * accum * size
    if info.train_size >= global_batch:
        return None
    return (
        f"{info.path}: {info.train_size} training samples do not fill one global batch "
        f"of {global_batch} (train.batch_size {batch} x {accum_key} {accum} x {size} "
        "data-parallel replica(s))"
    )


class ShardedTrainData:
    """Per-rank micro-batches of the training split, in step order, prefetched."""

    def __init__(
        self,
        info: DatasetInfo,
        rank: int,
        size: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        prefetch: int = 2,
        in_memory_bytes: int = 0,
        node_group=None,
        accum_key: str = "train.grad_accum",
    ):
        self.info, self.rank, self.size = info, rank, size
        self.batch, self.accum, self.seed = batch_size, grad_accum, seed
        self.global_batch = batch_size * grad_accum * size
        self.steps_per_epoch = info.train_size // self.global_batch
        problem = batch_problem(info, size, batch_size, grad_accum, accum_key)
        if problem is not None:
            raise DataError(problem)
        self.prefetch = prefetch
        # Read now, before the model: the memory check's resident baseline includes it.
        # With `node_group` (a GuardedComm of the ranks that read this data, all calling
        # together) one copy per node is shared by its ranks (runtime/node_shared.py).
        self._shared = None
        self.in_memory = None
        self.memory_note = None  # for the run's data line: where the split is held
        specs = _split_specs(info) if in_memory_bytes > 0 else None
        if specs is not None and _nbytes(specs) <= in_memory_bytes:
            if node_group is None:  # this rank alone
                arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in specs.items()}
                _fill_split(info, arrays)
                self.in_memory = arrays["x"], arrays["y"]
                self.memory_note = "training split in memory"
            else:
                self._shared = NodeShared(
                    node_group,
                    specs,
                    partial(_fill_split, info),
                    f"the training split of {info.path}",
                )
                self.in_memory = self._shared.arrays["x"], self._shared.arrays["y"]
                self.memory_note = (
                    f"training split in memory: {self._shared.nbytes / (1 << 20):.1f} MiB, one "
                    f"copy per node ({self._shared.copies} for {node_group.size} ranks)"
                )

    def close(self) -> None:
        """Release the node's shared copy (collective over the node's ranks of the
        group given); a private copy goes with the object."""
        self.in_memory = None
        if self._shared is not None:
            self._shared.free()
            self._shared = None

    def micro_batch_rows(self, epoch: int, position: int, perm=None) -> list[np.ndarray]:
        """Rows of this rank's micro-batches for the step starting at sample `position`."""
        perm = epoch_permutation(self.info.train_size, self.seed, epoch) if perm is None else perm
        rows = []
        for m in range(self.accum):
            start = position + (m * self.size + self.rank) * self.batch
            rows.append(perm[start : start + self.batch])
        return rows

    def steps_left(self, position: int) -> int:
        return (self.info.train_size - position) // self.global_batch

    def iterate(self, epoch: int, position: int = 0):
        """Yield lists of (x, y) micro-batches, one list per step, from `position` on."""
        steps = self.steps_left(position)
        if self.prefetch <= 0:
            with self._source() as f:
                perm = epoch_permutation(self.info.train_size, self.seed, epoch)
                for s in range(steps):
                    yield self._load(f, epoch, position + s * self.global_batch, perm)
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def producer():
            try:
                with self._source() as f:
                    perm = epoch_permutation(self.info.train_size, self.seed, epoch)
                    for s in range(steps):
                        if stop.is_set():
                            return
                        q.put(self._load(f, epoch, position + s * self.global_batch, perm))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                q.put(exc)
                return
            q.put(None)

        thread = threading.Thread(target=producer, name="hpctrain-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise DataError(f"reading {self.info.path}: {item}") from item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)

    def _source(self):
        """The open file, or (in memory) nothing to open."""
        return (
            contextlib.nullcontext()
            if self.in_memory is not None
            else h5py.File(self.info.path, "r")
        )

    def _load(self, f, epoch, position, perm):
        info = self.info
        out = []
        for rows in self.micro_batch_rows(epoch, position, perm):
            if self.in_memory is not None:  # already in split order: a numpy index
                x, y = self.in_memory
                out.append(info.convert(x[rows], y[rows]))
                continue
            file_rows = rows if info.train_rows is None else info.train_rows[rows]
            x_ds, y_ds = f[info.keys.train_x], f[info.keys.train_y]
            out.append(info.convert(_read_rows(x_ds, file_rows), _read_rows(y_ds, file_rows)))
        return out


def split_bytes(info: DatasetInfo) -> int:
    """Bytes of the training split's x and y as stored (what holding it in memory costs)."""
    return _nbytes(_split_specs(info))


def _split_specs(info: DatasetInfo) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of the training split's x and y in memory (one open of the file:
    metadata only). With validation held out of the file's split, train_size rows."""
    with h5py.File(info.path, "r") as f:
        return {
            name: ((info.train_size, *f[key].shape[1:]), f[key].dtype)
            for name, key in (("x", info.keys.train_x), ("y", info.keys.train_y))
        }


def _nbytes(specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        for shape, dtype in specs.values()
    )


def _fill_split(info: DatasetInfo, arrays: dict[str, np.ndarray]) -> None:
    """Read the training split's x and y into `arrays` (split order): one sequential read
    of each dataset, the held-out validation rows skipped. On a node sharing the split
    (runtime/node_shared.py) only its first rank calls this: the filesystem serves
    nodes x S at start (S <= data.in_memory_mb: at 256 MiB and 8 ranks a node, 32 GiB
    for 1,024 ranks and 128 GiB for 4,096; a copy per rank would be 256 GiB and 1 TiB)."""
    with h5py.File(info.path, "r") as f:
        for name, key in (("x", info.keys.train_x), ("y", info.keys.train_y)):
            if info.train_rows is None:
                f[key].read_direct(arrays[name])
            else:
                arrays[name][...] = f[key][()][info.train_rows]


def val_block(val_size: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous [start, stop) of the validation rows this rank evaluates."""
    bounds = np.linspace(0, val_size, size + 1).astype(np.int64)
    return int(bounds[rank]), int(bounds[rank + 1])


def val_batch_count(val_size: int, size: int, batch_size: int) -> int:
    """How many batches `iterate_val` yields on every one of `size` ranks."""
    largest = -(-val_size // size)  # the largest rank's rows
    return -(-largest // batch_size)


def iterate_val(info: DatasetInfo, rank: int, size: int, batch_size: int):
    """This rank's validation rows in batches.

    Every rank yields the same number of batches (its block split evenly), because
    layers that communicate inside the forward pass (MoE all-to-all) need every rank to
    run the same number of forwards; a rank with fewer rows gets slightly smaller batches.
    """
    start, stop = val_block(info.val_size, rank, size)
    n_batches = val_batch_count(info.val_size, size, batch_size)
    bounds = np.linspace(start, stop, n_batches + 1).astype(np.int64) if n_batches else []
    with h5py.File(info.path, "r") as f:
        keys = info.keys
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if info.val_rows is None:
                x, y = f[keys.val_x][lo:hi], f[keys.val_y][lo:hi]
            else:  # held out of the training datasets
                rows = info.val_rows[lo:hi]
                x, y = _read_rows(f[keys.train_x], rows), _read_rows(f[keys.train_y], rows)
            yield info.convert(x, y)


class BenchmarkData:
    """Horovod's synthetic-benchmark mode: one fixed random batch, reused every step."""

    def __init__(
        self,
        inp: InputSpec,
        batch_size: int,
        grad_accum: int,
        size: int,
        seed: int,
        steps_per_epoch: int,
    ):
        rng = np.random.default_rng(seed)
        if inp.tokens:
            x = rng.integers(0, inp.classes, (batch_size, *inp.shape))
            y = rng.integers(0, inp.classes, (batch_size, *inp.shape))
        else:
            x = rng.standard_normal((batch_size, *inp.shape)).astype(np.float32)
            y = rng.integers(0, inp.classes, batch_size)
        self.batch = [(x, y.astype(np.int64))] * grad_accum
        self.steps_per_epoch = steps_per_epoch
        self.global_batch = batch_size * grad_accum * size

    def steps_left(self, position: int) -> int:
        return self.steps_per_epoch - position // self.global_batch

    def close(self) -> None:
        """Nothing shared to release (the batch is this rank's own)."""

    def iterate(self, epoch: int, position: int = 0):
        for _ in range(self.steps_left(position)):
            yield self.batch
