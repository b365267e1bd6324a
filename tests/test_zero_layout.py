"""The ZeRO layout (exchange/zero.py) without MPI: every element of the padded flat
vector belongs to exactly one rank's shard, shards round-trip to the full vector, and
the segments follow the bucket plan (stage 2) or are one (stage 1)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.exchange.zero import ZeroPartition

SIZES = [300, 7, 4096, 1, 1000, 5000, 33, 2048]


def _parts(n, stage, bucket_bytes=8000):
    return [
        ZeroPartition(SimpleNamespace(size=n, rank=r), SIZES, stage, bucket_bytes) for r in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_shards_partition_the_flat_vector_and_round_trip(n, stage):
    parts = _parts(n, stage)
    p = parts[0]
    arrays = [np.arange(s, dtype=np.float32) + 10 * i for i, s in enumerate(SIZES)]
    flat = p.flatten(arrays)
    assert p.flat_len % n == 0 and p.shard_len * n == p.flat_len
    for view, a in zip(p.views(flat), arrays, strict=True):
        np.testing.assert_array_equal(view, a)  # parameters sit where views say
    shards = np.stack([q.shard_of(flat) for q in parts])
    np.testing.assert_array_equal(p.unshard(shards), flat)
    # Padding is zero and only at segment ends: fewer than n elements per segment.
    assert p.flat_len - sum(SIZES) < n * len(p.segments)


def test_stage_one_has_one_segment_stage_two_follows_the_buckets():
    one, two = _parts(2, 1)[0], _parts(2, 2)[0]
    assert len(one.segments) == 1
    assert len(two.segments) > 2
    covered = [i for seg in two.segments for i in seg.params]
    assert covered == list(range(len(SIZES)))  # ascending, each parameter once
    for seg in two.segments:
        assert list(seg.params) == list(range(seg.params[0], seg.params[-1] + 1))


def test_expected_bytes_follow_the_zero_memory_model():
    p = _parts(4, 2)[0]
    model = p.expected_bytes(slots=2)
    psi = sum(SIZES)
    assert model["zero_model_param_bytes"] == psi * 4
    assert model["zero_model_optimizer_bytes"] == pytest.approx(2 * psi * 4 / 4, rel=0.01)
    assert model["zero_model_grad_bytes"] == pytest.approx(psi * 4 / 4, rel=0.01)
