"""Gradient compressors (exchange/compression), in every rank of a real job: the 16-bit
rings sum in float32, exact settings equal the dense average, error feedback keeps what
was not sent, and the bytes counted are the bytes on the wire."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.exchange.compression import HalfRing, PowerSGD, RandomK, TopK, halfring
from hpctrain.exchange.compression import build as build_compressor
from hpctrain.runtime import world

SHAPES = [(64, 32), (32,), (10, 64), (10,), (7, 3, 3)]
OPTS = {"ratio": 0.1, "rank": 4, "error_feedback": True, "warmup_steps": 0, "seed": 0}


def _grads(rank: int, scale=1.0) -> np.ndarray:
    n = sum(int(np.prod(s)) for s in SHAPES)
    return (np.random.default_rng(11 + rank).standard_normal(n) * scale).astype(np.float32)


def _dense_mean(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float64)
    MPI.COMM_WORLD.Allreduce(x.astype(np.float64), out, op=MPI.SUM)
    return out / MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("kind, tol", [("fp16", 1e-3), ("bf16", 8e-3)])
def test_half_ring_equals_the_average_within_half_precision(kind, tol):
    w = world()
    g = _grads(w.rank)
    ring = HalfRing(w, [g.size], kind)
    ring.buffer[:] = g
    ring.reduce(0)
    ref = _dense_mean(g)
    np.testing.assert_allclose(ring.buffer, ref, rtol=tol, atol=tol)
    # Every replica holds the same bits (the owner of a chunk uses its rounded value).
    everyone = np.empty((w.size, g.size), np.float32)
    MPI.COMM_WORLD.Allgather(ring.buffer, everyone)
    assert (everyone == everyone[0]).all()
    if w.size > 1:  # 16-bit numbers: half the bytes of the float32 ring
        assert abs(ring.stats()["compression_ratio"] - 2.0) < 0.01


@pytest.mark.parametrize("kind, tol", [("fp16", 1e-3), ("bf16", 8e-3)])
def test_half_ring_in_many_pieces_equals_the_average(kind, tol, monkeypatch):
    """Chunks travel in pieces (encoding, wire and decoding overlap); cut small here so
    every hop has several pieces, and a last short one."""
    monkeypatch.setattr(halfring, "PIECE", 1000)
    w = world()
    g = np.random.default_rng(11 + w.rank).normal(0, 1e-2, 10_007).astype(np.float32)
    ring = HalfRing(w, [g.size], kind)
    ring.buffer[:] = g
    ring.reduce(0)
    np.testing.assert_allclose(ring.buffer, _dense_mean(g), rtol=tol, atol=tol * 1e-2)
    everyone = np.empty((w.size, g.size), np.float32)
    MPI.COMM_WORLD.Allgather(ring.buffer, everyone)
    assert (everyone == everyone[0]).all()


def test_fp16_bits_equal_numpys_cast_in_the_normal_range():
    y = np.random.default_rng(3).standard_normal(100_000).astype(np.float32) * 1e3
    y = np.concatenate([y, np.float32([1 + 2**-11, 1 + 3 * 2**-11, 2**-14, -0.0, 32767])])
    normal = np.abs(y) >= 2**-14
    got = halfring._f16_bits(y.copy())
    assert (got[normal] == y.astype(np.float16).view(np.uint16)[normal]).all()
    assert (got[~normal] & 0x7FFF == 0).all()  # under 2^-14: zero


def test_half_ring_error_is_one_rounding_per_hop():
    """Partial sums travel in 16 bits, so each of the N hops may round once (relative
    2^-11 for float16, 2^-8 for bfloat16); the adds themselves are float32."""
    w = world()
    g = np.random.default_rng(5 + w.rank).uniform(0.5, 2.0, 4096).astype(np.float32)
    exact = _dense_mean(g)
    for kind, unit in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        ring = HalfRing(w, [g.size], kind)
        ring.buffer[:] = g
        ring.reduce(0)
        rel = np.abs(ring.buffer - exact) / exact
        assert rel.max() <= (w.size + 1) * unit, (kind, rel.max())


def test_topk_with_ratio_one_and_powersgd_with_full_rank_equal_the_dense_average():
    w = world()
    g = _grads(w.rank)
    for reducer in (
        TopK(w, SHAPES, {**OPTS, "ratio": 1.0}, "test"),
        PowerSGD(w, SHAPES, {**OPTS, "rank": 64}, "test"),
    ):
        reducer.buffer[:] = g
        reducer.reduce(0)
        np.testing.assert_allclose(reducer.buffer, _dense_mean(g), rtol=1e-4, atol=1e-5)
        assert np.abs(reducer.residual).max() < 1e-4  # nothing left behind


@pytest.mark.parametrize("method", ["topk", "randomk", "int8", "powersgd"])
def test_error_feedback_keeps_exactly_what_was_not_sent(method):
    """Over steps, the sum of what was applied plus the residual equals the sum of the
    gradients given: sum_t avg_t + mean_r(residual_r) == mean_r(sum_t g_r,t)."""
    w = world()
    reducer = build_compressor(method, w, SHAPES, OPTS, "test")
    applied = np.zeros(reducer.buffer.size, np.float64)
    given = np.zeros(reducer.buffer.size, np.float64)
    for step in range(4):
        g = _grads(w.rank + 10 * step)
        given += g
        reducer.buffer[:] = g
        reducer.reduce(step)
        applied += reducer.buffer
    left = _dense_mean(reducer.residual)
    tol = 2e-2 if method == "int8" else 1e-4
    np.testing.assert_allclose(applied + left, _dense_mean(given), rtol=tol, atol=tol)
    if w.size > 1:
        assert reducer.stats()["compression_ratio"] > 1.0


def test_randomk_without_error_feedback_is_unbiased():
    w = world()
    g = _grads(w.rank)
    mean = np.zeros(g.size)
    trials = 400
    reducer = RandomK(w, SHAPES, {**OPTS, "error_feedback": False, "ratio": 0.25}, "test")
    for step in range(trials):
        reducer.buffer[:] = g
        reducer.reduce(step)
        mean += reducer.buffer / trials
    ref = _dense_mean(g)
    # Each entry is kept with probability 1/4 and scaled by 4: the mean converges to it.
    assert np.abs(mean - ref).mean() < 0.15 * np.abs(ref).mean() + 0.05


def test_topk_sends_the_counted_bytes_and_warmup_is_dense():
    w = world()
    g = _grads(w.rank)
    reducer = TopK(w, SHAPES, {**OPTS, "ratio": 0.01, "warmup_steps": 1}, "test")
    reducer.buffer[:] = g
    reducer.reduce(0)  # warm-up: dense
    np.testing.assert_allclose(reducer.buffer, _dense_mean(g), rtol=1e-5, atol=1e-6)
    reducer.buffer[:] = g
    reducer.reduce(1)
    k = max(1, int(g.size * 0.01))
    assert reducer.stats()["comm_bytes"] == 8 * k * (w.size - 1)
    assert np.count_nonzero(reducer.buffer) <= k * w.size


@pytest.fixture(scope="module")
def gloo():
    """The process-group transport over the whole job (torch tensors over Gloo: the
    code GPU ranks run over NCCL)."""
    import torch
    import torch.distributed as dist

    from hpctrain.backends.torch_transport import ProcessGroupTransport

    yield ProcessGroupTransport(world(), "gloo", 60.0, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("method", ["topk", "randomk", "int8", "powersgd"])
def test_a_compressor_on_torch_tensors_over_gloo_equals_it_on_numpy_over_mpi(
    gloo, method, feedback, monkeypatch
):
    """The same compressor code over the process group's transport: every buffer a torch
    tensor, no numpy round trip during a step, the same averages, residuals, warm-start
    factors and bytes as over MPI on numpy: bit for bit for top-k and int8 (allgathered,
    summed locally in rank order) and for random-k at np 2; PowerSGD within float32
    rounding (numpy's QR runs in float64, torch's in float32). Allreduces (random-k's
    values, the dense warm-up step) are Gloo's and Open MPI's, which at np 4 add in
    different orders: there the last bit may differ."""
    import torch

    opts = {**OPTS, "error_feedback": feedback, "warmup_steps": 1}
    host = build_compressor(method, world(), SHAPES, opts, "test")
    device = build_compressor(method, gloo, SHAPES, opts, "test")
    assert isinstance(device.buffer, torch.Tensor)
    for step in range(4):
        allreduced = method == "randomk" or step == 0
        exact = method != "powersgd" and (world().size <= 2 or not allreduced)
        g = _grads(world().rank + 10 * step)
        host.buffer[:] = g
        device.buffer[:] = torch.from_numpy(g)
        host.reduce(step)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "numpy", lambda *_: pytest.fail("numpy in a step"))
            device.reduce(step)
        assert device.stats() == host.stats(), step
        got, want = device.state(), host.state()
        assert got.keys() == want.keys()
        for a, b in [(device.buffer.numpy(), host.buffer), *((got[k], want[k]) for k in want)]:
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
            else:
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
    # a checkpointed state loads into the other kind (same values)
    device.load_state(host.state())
    for k, v in device.state().items():
        np.testing.assert_array_equal(v, host.state()[k])


@pytest.mark.parametrize("kind, tol", [("fp16", 1e-3), ("bf16", 8e-3)])
def test_16_bit_mean_on_a_process_group_equals_the_average_and_cannot_overflow(gloo, kind, tol):
    """fp16/bf16 on the process-group engine: the library's 16-bit allreduce of the
    gradients divided by N first (as DDP's fp16 hook); within half precision of the
    mean, the same bits on every rank, half the float32 bytes. The division matters: a
    gradient of 40,000 on every rank overflows fp16 when summed undivided."""
    import torch

    from hpctrain.exchange.compression import HalfMean

    w = world()
    g = _grads(w.rank)
    mean = HalfMean(gloo, [g.size], kind)
    mean.buffer[:] = torch.from_numpy(g)
    mean.reduce(0)
    got = mean.buffer.numpy()
    np.testing.assert_allclose(got, _dense_mean(g), rtol=tol, atol=tol)
    everyone = np.empty((w.size, g.size), np.float32)
    MPI.COMM_WORLD.Allgather(got, everyone)
    assert (everyone == everyone[0]).all()
    if w.size > 1:
        assert mean.stats()["compression_ratio"] == pytest.approx(2.0)
    if kind == "fp16" and w.size > 1:
        mean.buffer[:] = 40_000.0
        mean.reduce(1)
        assert torch.isfinite(mean.buffer).all() and float(mean.buffer[0]) == 40_000.0
        undivided = torch.full((4,), 40_000.0, dtype=torch.float16)
        gloo.allreduce_inplace(undivided, "sum", "undivided fp16")
        assert torch.isinf(undivided).all()
