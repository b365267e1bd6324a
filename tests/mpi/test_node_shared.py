"""One copy per node (runtime/node_shared.py) in every rank of a real job: the node's
first rank fills the window once, every rank of the node reads the same bytes, a failed
fill is one DataError on every rank, and the training split read this way gives the
batches the file gives (data/sharded.py)."""

import h5py
import numpy as np
import pytest

from hpctrain.data.dataset import DataOptions, DatasetInfo, inspect_dataset
from hpctrain.data.sharded import ShardedTrainData
from hpctrain.data.synthetic import generate, write_dataset
from hpctrain.errors import DataError
from hpctrain.models.zoo import InputSpec
from hpctrain.runtime import world
from hpctrain.runtime.node_shared import NodeShared


def _specs():
    return {"a": ((5, 3), np.float32), "b": ((7,), np.int64), "empty": ((0, 4), np.uint8)}


def test_the_node_fills_once_and_every_rank_reads_the_same_arrays():
    w = world()
    calls = []

    def fill(arrays):
        calls.append(w.rank)
        arrays["a"][...] = np.arange(15, dtype=np.float32).reshape(5, 3)
        arrays["b"][...] = np.arange(7) * 11

    shared = NodeShared(w, _specs(), fill, "test arrays")
    try:
        assert np.array_equal(shared.arrays["a"], np.arange(15).reshape(5, 3))
        assert np.array_equal(shared.arrays["b"], np.arange(7) * 11)
        assert shared.arrays["empty"].shape == (0, 4)
        assert not shared.arrays["a"].flags.writeable
        fills = w.allgather_object(len(calls))
        # one fill per node, by the node's first rank
        assert sum(fills) == w.layout.nodes, fills
        assert len(calls) == (1 if w.local_rank == 0 else 0)
        assert shared.writer == (w.local_rank == 0)
    finally:
        shared.free()
    assert shared.arrays == {}


def test_a_failed_fill_is_one_data_error_on_every_rank():
    w = world()

    def fill(arrays):
        raise OSError("disk quota exceeded")

    with pytest.raises(DataError, match="test arrays: OSError: disk quota exceeded"):
        NodeShared(w, _specs(), fill, "test arrays")
    w.barrier("after the failed fill")  # every rank got here: none left waiting


def test_a_sub_group_shares_per_node_among_its_own_ranks():
    """The parameter server's workers share among themselves: a group smaller than the
    world splits by node on its own."""
    w = world()
    if w.size < 2:
        pytest.skip("needs two ranks")
    group = w.guarded_split("node-shared-test", 0 if w.rank < w.size - 1 else 1)
    shared = NodeShared(group, {"v": ((3,), np.float64)}, lambda a: a["v"].fill(group.size), "v")
    try:
        assert np.array_equal(shared.arrays["v"], np.full(3, group.size, np.float64))
    finally:
        shared.free()


@pytest.mark.parametrize("held_out", [False, True])
def test_the_split_in_shared_memory_gives_the_batches_the_file_gives(tmp_path_factory, held_out):
    """Both the file's own split and one with validation held out of it."""
    w = world()
    path = tmp_path_factory.getbasetemp() / f"split-{w.size}-{held_out}.h5"
    path = w.bcast_object(str(path), what="the root's test file")  # its own temp dir
    splits, attrs = generate("vectors", 96, 16, seed=5, features=6, classes=4)
    if w.is_root and held_out:  # one split only: validation is held out of it
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = splits["train"]
    elif w.is_root:
        write_dataset(path, splits, attrs)
    w.barrier("the test file written")
    if held_out:
        info = inspect_dataset(str(path), DataOptions(val_fraction=0.25, seed=1))
    else:
        info = DatasetInfo(str(path), 96, 16, InputSpec((6,), 4), "float32", {})
    common = dict(rank=w.rank, size=w.size, batch_size=4, grad_accum=2, seed=1, prefetch=0)
    from_file = ShardedTrainData(info, **common)
    shared = ShardedTrainData(info, **common, in_memory_bytes=1 << 20, node_group=w)
    try:
        assert from_file.in_memory is None and shared.in_memory is not None
        steps = 0
        for a, b in zip(from_file.iterate(1), shared.iterate(1), strict=True):
            for (xa, ya), (xb, yb) in zip(a, b, strict=True):
                np.testing.assert_array_equal(xa, xb)
                np.testing.assert_array_equal(ya, yb)
            steps += 1
        assert steps == info.train_size // (8 * w.size)
    finally:
        shared.close()
