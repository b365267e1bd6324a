"""The overlapped engine's buckets (exchange/overlap.py), in every rank of a real job:
bucketed, hook-order averaging equals one MPI_Allreduce of the whole buffer, whatever
order each rank's gradients arrive in, and missing gradients never reorder collectives."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.exchange.overlap import OverlapMean, bucket_plan
from hpctrain.runtime import world

SIZES = [300, 7, 4096, 1, 1000, 50_000, 33, 2048]


def _grads(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7 + rank)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


def _reference(grads) -> np.ndarray:
    flat = np.concatenate(grads)
    out = np.empty_like(flat)
    MPI.COMM_WORLD.Allreduce(flat, out, op=MPI.SUM)
    return out / MPI.COMM_WORLD.Get_size()


def test_buckets_cover_the_buffer_in_reverse_order_as_contiguous_ranges():
    plan = bucket_plan(SIZES, bucket_bytes=16_000)
    assert [i for b in plan for i in b] == list(reversed(range(len(SIZES))))
    for b in plan:
        assert sorted(b) == list(range(min(b), max(b) + 1))
        assert sum(SIZES[i] for i in b) * 4 >= 16_000 or b is plan[-1]


@pytest.mark.parametrize("bucket_bytes", [1, 16_000, 1 << 30])
@pytest.mark.parametrize("poll_s", [0.0, 0.0005])
def test_hook_order_average_equals_one_allreduce(bucket_bytes, poll_s):
    w = world()
    grads = _grads(w.rank)
    engine = OverlapMean(w, SIZES, bucket_bytes, poll_s=poll_s)
    # Each rank sees its gradients in a different order (as if backward differed).
    order = np.random.default_rng(w.rank).permutation(len(SIZES))
    for step in range(3):
        engine.begin()
        for i in order:
            engine.views[i][:] = grads[i] * (step + 1)
            engine.ready(int(i))
        engine.finish()
        np.testing.assert_allclose(
            engine.buffer, _reference(grads) * (step + 1), rtol=1e-6, atol=1e-6
        )
    n = w.size
    ring = sum(2 * (n - 1) * (hi - lo) * 4 // n for lo, hi in engine.ranges)
    assert engine.stats()["comm_bytes"] == (ring if n > 1 else 0)
    engine.close()


def test_a_gradient_missing_on_one_rank_holds_back_later_buckets_in_order():
    """Rank 0 never marks gradient 6 ready before finish(); its buckets start in order."""
    w = world()
    grads = _grads(w.rank)
    engine = OverlapMean(w, SIZES, 1)  # one gradient per bucket
    engine.begin()
    for i in reversed(range(len(SIZES))):
        engine.views[i][:] = grads[i]
        if not (w.rank == 0 and i == 6):
            engine.ready(i)
    if w.rank == 0:
        engine.ready(6)  # late, as the trainer does for parameters without gradient
    engine.finish()
    np.testing.assert_allclose(engine.buffer, _reference(grads), rtol=1e-6, atol=1e-6)
    engine.close()


def test_reduce_after_backward_equals_one_allreduce():
    w = world()
    grads = _grads(w.rank)
    engine = OverlapMean(w, SIZES, 8192)
    for v, g in zip(engine.views, grads, strict=True):
        v[:] = g
    engine.reduce(0)
    np.testing.assert_allclose(engine.buffer, _reference(grads), rtol=1e-6, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("bucket_bytes", [1, 16_000])
def test_the_same_engine_over_a_gloo_group_keeps_torch_buffers_and_equals_one_allreduce(
    bucket_bytes,
):
    """`train.allreduce=gloo|nccl`: the engine written once, over the process-group
    transport: the buffer and its bucket views are torch tensors (on the device on a GPU
    rank), buckets start from `ready()` before `finish()`, and the average equals MPI's."""
    import torch
    import torch.distributed as dist

    from hpctrain.backends.torch_transport import ProcessGroupTransport

    w = world()
    if w.size < 2:
        pytest.skip("a process group needs two ranks")
    pg = ProcessGroupTransport(w, "gloo", 60.0, torch.device("cpu"))
    try:
        grads = _grads(w.rank)
        engine = OverlapMean(pg, SIZES, bucket_bytes, poll_s=0.0)
        assert isinstance(engine.buffer, torch.Tensor)
        assert all(isinstance(v, torch.Tensor) for v in engine.views)
        order = np.random.default_rng(w.rank).permutation(len(SIZES))
        for step in range(2):
            engine.begin()
            for i in order:
                engine.views[i].copy_(torch.from_numpy(grads[i] * (step + 1)))
                engine.ready(int(i))
            started_before_finish = engine.started  # sent from the hooks, before finish
            engine.finish()
            assert started_before_finish == len(engine.buckets)
            np.testing.assert_allclose(
                engine.buffer.numpy(), _reference(grads) * (step + 1), rtol=1e-6, atol=1e-6
            )
        engine.close()
    finally:
        dist.destroy_process_group()
