"""ZeRO's collectives (exchange/zero.py) in every rank of a real job: the shards of the
reduce-scatter are the allreduce mean, the norm from shards is the whole gradient's,
the allgather rebuilds every replica, and the checkpoint gather lands only on rank 0."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.exchange.zero import ZeroPartition
from hpctrain.runtime import world

SIZES = [300, 7, 4096, 1, 1000, 5000, 33, 2048]


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatter_norm_and_allgather_equal_the_replicated_math(stage):
    w = world()
    part = ZeroPartition(w, SIZES, stage, bucket_bytes=8000)
    rng = np.random.default_rng(11 + w.rank)
    grads = part.flatten([rng.standard_normal(s).astype(np.float32) for s in SIZES])
    mean = np.empty_like(grads)
    MPI.COMM_WORLD.Allreduce(grads, mean, op=MPI.SUM)
    mean /= w.size
    shard = np.zeros(part.shard_len, np.float32)
    part.reduce_all(grads, shard)
    np.testing.assert_allclose(shard, part.shard_of(mean), rtol=1e-6, atol=1e-7)
    norm = float(np.sqrt(part.global_square_sum(shard)))
    assert norm == pytest.approx(float(np.linalg.norm(mean)), rel=1e-6)
    flat = np.full(part.flat_len, np.nan, np.float32)
    part.gather_params(shard, flat)
    np.testing.assert_allclose(flat, mean, rtol=1e-6, atol=1e-7)
    full = part.gather_full(shard, "test gather")
    if w.rank == 0:
        np.testing.assert_allclose(full, mean, rtol=1e-6, atol=1e-7)
    else:
        assert full is None
    n = w.size
    assert part.take_sent() == (2 * (n - 1) * part.flat_len * 4 // n if n > 1 else 0)
