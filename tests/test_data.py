"""Sharding rules: every sample read once per step across ranks, validation covered once."""

import numpy as np
import pytest

from hpctrain.data.sharded import DatasetInfo, ShardedTrainData, epoch_permutation, val_block
from hpctrain.data.synthetic import generate, write_dataset
from hpctrain.errors import DataError
from hpctrain.models.zoo import InputSpec


def _info(n):
    return DatasetInfo("unused.h5", n, 0, InputSpec((4,), 3), "float32", {})


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("val_size", [0, 1, 7, 1000, 1001])
def test_validation_blocks_cover_every_sample_exactly_once(size, val_size):
    covered = []
    for r in range(size):
        lo, hi = val_block(val_size, r, size)
        covered += range(lo, hi)
    assert covered == list(range(val_size))


def test_ranks_together_read_what_one_rank_reads_with_the_global_batch():
    n, b, a = 1000, 8, 2
    one = ShardedTrainData(_info(n), 0, 1, b * 2 * a, 1, seed=3, prefetch=0)
    two = [ShardedTrainData(_info(n), r, 2, b, a, seed=3, prefetch=0) for r in range(2)]
    assert one.global_batch == two[0].global_batch == 32
    for pos in (0, 32, 64):
        whole = one.micro_batch_rows(epoch=1, position=pos)[0]
        parts = [rows for r in range(2) for rows in two[r].micro_batch_rows(1, pos)]
        assert sorted(np.concatenate(parts)) == sorted(whole)
        assert len(np.unique(np.concatenate(parts))) == 32


def test_shuffle_depends_on_seed_and_epoch_only():
    assert np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 2))
    assert not np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 3))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="do not fill one global batch"):
        ShardedTrainData(_info(10), 0, 4, 8, 1, seed=0)


def test_prefetched_batches_equal_direct_reads(tmp_path):
    splits, attrs = generate("vectors", 300, 20, seed=5, features=4, classes=3)
    path = write_dataset(tmp_path / "d.h5", splits, attrs)
    info = DatasetInfo(str(path), 300, 20, InputSpec((4,), 3), "float32", {})
    a = list(ShardedTrainData(info, 1, 2, 16, 1, seed=0, prefetch=2).iterate(0, 32))
    b = list(ShardedTrainData(info, 1, 2, 16, 1, seed=0, prefetch=0).iterate(0, 32))
    assert len(a) == len(b) == (300 - 32) // 32
    x_all = splits["train"][0]
    rows = ShardedTrainData(info, 1, 2, 16, 1, seed=0).micro_batch_rows(0, 32)[0]
    np.testing.assert_array_equal(a[0][0][0], x_all[rows])
    for sa, sb in zip(a, b, strict=True):
        np.testing.assert_array_equal(sa[0][0], sb[0][0])
        np.testing.assert_array_equal(sa[0][1], sb[0][1])


def test_synthetic_tasks_are_deterministic_and_learnable_in_shape():
    for task in ("vectors", "images", "tokens"):
        s1, a1 = generate(task, 64, 16, seed=9)
        s2, _ = generate(task, 64, 16, seed=9)
        np.testing.assert_array_equal(s1["train"][0], s2["train"][0])
        assert len(s1["val"][0]) == 16 and a1["classes"] >= 2
    _, attrs = generate("tokens", 64, 16, seed=9)
    assert 0.1 < attrs["bayes_accuracy"] <= 1.0


@pytest.mark.parametrize("val_size,size,batch", [(1001, 4, 256), (257, 2, 256), (5, 4, 2)])
def test_every_rank_runs_the_same_number_of_validation_batches(tmp_path, val_size, size, batch):
    from hpctrain.data.sharded import iterate_val

    splits, attrs = generate("vectors", 64, val_size, seed=1, features=4, classes=3)
    path = write_dataset(tmp_path / "v.h5", splits, attrs)
    info = DatasetInfo(str(path), 64, val_size, InputSpec((4,), 3), "float32", {})
    per_rank = [list(iterate_val(info, r, size, batch)) for r in range(size)]
    assert len({len(batches) for batches in per_rank}) == 1
    rows = np.concatenate([x for batches in per_rank for x, _ in batches])
    np.testing.assert_array_equal(rows, splits["val"][0])  # every sample exactly once
