"""The exchange layer's transports in every rank of a real job: the MPI one (host numpy,
runtime.comm.GuardedComm) and the process-group one (torch tensors over Gloo,
backends/torch_transport.py) implement every method of the `Transport` Protocol and give
the same values for the same inputs: blocking and non-blocking collectives, uneven
reduce-scatter and allgather counts, send/recv around a ring, the array seam, and
ZeRO's partition written once over both. Integer-valued float32 inputs make every sum
exact, so the two must agree bit for bit (the norms to float64 rounding)."""

import inspect
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from host_reads import HostReads

from hpctrain.backends.torch_transport import CollectiveError, ProcessGroupTransport
from hpctrain.exchange.transport import Pending, Transport, protocol_methods
from hpctrain.exchange.zero import ZeroPartition
from hpctrain.runtime import world
from hpctrain.runtime.comm import GuardedComm
from hpctrain.tensor.parallel import TensorGroup, split_kind


@pytest.fixture(scope="module")
def both():
    """(MPI transport, Gloo transport) over the whole job."""
    w = world()
    pg = ProcessGroupTransport(w, "gloo", 60.0, torch.device("cpu"))
    yield w, pg
    dist.destroy_process_group()


def _ints(seed: int, n: int) -> np.ndarray:
    """Integer-valued float32 (exact sums), different on every rank."""
    rng = np.random.default_rng(seed + 1000 * world().rank)
    return rng.integers(-50, 50, n).astype(np.float32)


def _same(np_result, torch_result) -> None:
    assert isinstance(torch_result, torch.Tensor)
    np.testing.assert_array_equal(torch_result.numpy(), np_result)


@pytest.mark.parametrize("impl", [GuardedComm, ProcessGroupTransport])
def test_every_protocol_method_is_implemented_with_its_parameters(impl):
    methods = protocol_methods(Transport)
    collectives = ["allreduce_inplace", "reduce_scatter_sum", "allgather_into", "all_to_all"]
    p2p = ["send", "recv"]
    starts = [f"start_{m}" for m in collectives + p2p if m != "reduce_scatter_sum"]
    arrays = {"zeros", "square_sum", "scale_", "clip_coefficient", "copy", "concat", "astype"}
    arrays |= {"bitcast", "square_sum_where"}
    arrays |= {"top_k_indices", "take", "put_", "index_add_", "round_clip", "qr"}
    arrays |= {"from_host", "to_host"}
    assert set(methods) == {*collectives, *p2p, *starts, *arrays, "all_to_all_v"}
    for name in methods:
        member = inspect.getattr_static(impl, name, None)
        assert member is not None, f"{impl.__name__} lacks {name}"
        assert callable(getattr(impl, name)), name
        want = list(inspect.signature(getattr(Transport, name)).parameters)[1:]
        got = list(inspect.signature(getattr(impl, name)).parameters)
        got = got[1:] if got and got[0] == "self" else got
        assert got == want, (impl.__name__, name, got, want)


def test_instances_are_transports_and_pendings(both):
    for t in both:
        assert isinstance(t, Transport)
        assert (t.rank, t.size) == (world().rank, world().size)
    pending = [both[0].start_allreduce_inplace(np.ones(3, np.float32))]
    pending.append(both[1].start_allreduce_inplace(torch.ones(3)))
    for p in pending:
        assert isinstance(p, Pending)
        assert float(p.wait()[0]) == world().size


@pytest.mark.parametrize("op", ["sum", "min", "max"])
@pytest.mark.parametrize("start", [False, True])
def test_allreduce(both, op, start):
    mpi, pg = both
    x = _ints(1, 37)
    a, b = x.copy(), torch.from_numpy(x.copy())
    if start:
        pa, pb = mpi.start_allreduce_inplace(a, op, "t"), pg.start_allreduce_inplace(b, op, "t")
        while not (pa.test() and pb.test()):
            pass
        a, b = pa.wait(), pb.wait()
    else:
        a, b = mpi.allreduce_inplace(a, op, "t"), pg.allreduce_inplace(b, op, "t")
    _same(a, b)
    everyone = mpi.allgather_array(x)
    _same({"sum": everyone.sum(0), "min": everyone.min(0), "max": everyone.max(0)}[op], b)


@pytest.mark.parametrize("even", [True, False])
def test_reduce_scatter_sum(both, even):
    mpi, pg = both
    n = mpi.size
    counts = [3] * n if even else [2 + r for r in range(n)]
    x = _ints(2, sum(counts))
    a = mpi.reduce_scatter_sum(x.copy(), counts, "t")
    b = pg.reduce_scatter_sum(torch.from_numpy(x.copy()), counts, "t")
    _same(a, b)
    lo = sum(counts[: mpi.rank])
    _same(mpi.allgather_array(x).sum(0)[lo : lo + counts[mpi.rank]], b)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("start", [False, True])
def test_allgather_into(both, even, start):
    mpi, pg = both
    n, r = mpi.size, mpi.rank
    counts = [4] * n if even else [1 + 2 * q for q in range(n)]
    mine = _ints(3, counts[r])
    a, b = np.full(sum(counts), np.nan, np.float32), torch.full((sum(counts),), float("nan"))
    if start:
        pa = mpi.start_allgather_into(mine, a, counts, "t")
        pb = pg.start_allgather_into(torch.from_numpy(mine), b, counts, "t")
        a, b = pa.wait(), pb.wait()
    else:
        a = mpi.allgather_into(mine, a, counts, "t")
        b = pg.allgather_into(torch.from_numpy(mine), b, counts, "t")
    _same(a, b)
    _same(np.concatenate(mpi.allgather_object(mine)), b)


@pytest.mark.parametrize("start", [False, True])
def test_all_to_all(both, start):
    mpi, pg = both
    n, r = mpi.size, mpi.rank
    send = (np.arange(5 * n) + 100 * r).astype(np.float32)
    a, b = np.empty_like(send), torch.empty(5 * n)
    if start:
        pa, pb = mpi.start_all_to_all(send, a, "t"), pg.start_all_to_all(torch.from_numpy(send), b)
        a, b = pa.wait(), pb.wait()
    else:
        a, b = mpi.all_to_all(send, a, "t"), pg.all_to_all(torch.from_numpy(send), b, "t")
    _same(a, b)
    want = np.concatenate([(np.arange(5 * r, 5 * r + 5) + 100 * q) for q in range(n)])
    _same(want.astype(np.float32), b)


def test_all_to_all_with_uneven_counts(both):
    """Mixture-of-experts rows: rank r sends r + q + 1 values to rank q (none to itself
    on rank 0 when it routes nothing there), the same on both transports."""
    mpi, pg = both
    n, r = mpi.size, mpi.rank
    send_counts = [(r + q + 1) * (q != r or r != 0) for q in range(n)]
    recv_counts = [(q + r + 1) * (q != r or r != 0) for q in range(n)]
    send = (np.arange(sum(send_counts)) + 1000 * r).astype(np.float32)
    a = mpi.all_to_all_v(
        send, np.empty(sum(recv_counts), np.float32), send_counts, recv_counts, "t"
    )
    b = pg.all_to_all_v(
        torch.from_numpy(send), torch.empty(sum(recv_counts)), send_counts, recv_counts, "t"
    )
    _same(a, b)
    # from rank q: its slice for this rank (q's sends before this rank are skipped)
    want = []
    for q in range(n):
        q_counts = [(q + k + 1) * (k != q or q != 0) for k in range(n)]
        start = sum(q_counts[:r])
        want.append(np.arange(start, start + q_counts[r]) + 1000 * q)
    _same(np.concatenate(want).astype(np.float32), b)


@pytest.mark.parametrize("start", [False, True])
def test_send_recv_around_a_ring(both, start):
    mpi, pg = both
    n, r = mpi.size, mpi.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    results = []
    for t, wrap in ((mpi, np.asarray), (pg, torch.from_numpy)):
        out, mine = wrap(np.zeros(6, np.float32)), wrap(np.full(6, 10.0 + r, np.float32))
        if start:
            pending = [t.start_recv(out, prev, 7, "ring"), t.start_send(mine, nxt, 7, "ring")]
            for p in pending:
                p.wait()
        elif r == 0:  # rank 0 sends first, every other rank receives first: no cycle
            t.send(mine, nxt, 7, "ring")
            t.recv(out, prev, 7, "ring")
        else:
            t.recv(out, prev, 7, "ring")
            t.send(mine, nxt, 7, "ring")
        results.append(out)
    _same(*results)
    _same(np.full(6, 10.0 + prev, np.float32), results[1])


def test_array_seam(both):
    mpi, pg = both
    for dtype in ("float32", "float64"):
        a, b = mpi.zeros(5, dtype), pg.zeros(5, dtype)
        assert str(a.dtype) == dtype and b.dtype == getattr(torch, dtype)
        _same(a, b)
    x = np.random.default_rng(4).standard_normal(1001).astype(np.float32)
    sa, sb = mpi.square_sum(x), pg.square_sum(torch.from_numpy(x))
    assert sb.dtype == torch.float64 and sb.dim() == 0
    assert float(sa) == pytest.approx(float(sb), rel=1e-14)
    mask = x > 0.5
    sa, sb = (
        mpi.square_sum_where(x, mask),
        pg.square_sum_where(torch.from_numpy(x), torch.from_numpy(mask)),
    )
    assert sb.dtype == torch.float64 and sb.dim() == 0
    assert float(sa) == pytest.approx(float(sb), rel=1e-14)
    assert float(sa) == pytest.approx(float(np.sum(x[mask].astype(np.float64) ** 2)), rel=1e-14)
    a, b = x.copy(), torch.from_numpy(x.copy())
    mpi.scale_(a, 1.0 / 3.0)
    pg.scale_(b, 1.0 / 3.0)
    _same(a, b)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_partition_is_the_same_over_both_transports(both, stage, split):
    """ZeroPartition written once: numpy over MPI and torch over Gloo give the same
    shard, norm, clip and gathered parameters; the clip over Gloo reads nothing on the
    host (tests/host_reads.py). `split`: with tensor parallelism's rule
    (the job's ranks as one tensor axis, parameters 0 and 2 split over it), whose sum
    over the axis stays on the transport's arrays; the clip's coefficient stays where
    the shard is (a tensor: no host read), equal to numpy's."""
    mpi, pg = both
    sizes = [300, 7, 4096, 1, 1000, 33]
    parts = [ZeroPartition(t, sizes, stage, bucket_bytes=4000) for t in both]
    grads = parts[0].flatten([_ints(5 + i, s) for i, s in enumerate(sizes)])
    mask = parts[0].shard_mask({0, 2})
    groups = (TensorGroup(mpi), TensorGroup(mpi, pg))
    out = []
    for part, wrap, group in zip(parts, (np.asarray, torch.from_numpy), groups, strict=True):
        shard = wrap(np.zeros(part.shard_len, np.float32))
        part.reduce_all(wrap(grads.copy()), shard)
        on = (wrap(mask.copy()), group) if split else None
        norm = float(np.sqrt(float(part.global_square_sum(shard, on))))
        with HostReads() as reads:
            coef = part.clip(shard, 0.5 * norm, on)
        flat = wrap(np.full(part.flat_len, np.nan, np.float32))
        part.gather_params(shard, flat)
        out.append((shard, norm, float(coef), flat, part.take_sent()))
    assert torch.is_tensor(coef) and coef.dtype == torch.float64
    assert reads.where == []  # the torch side's: no read, no boolean-mask gather
    (sa, na, ca, fa, ta), (sb, nb, cb, fb, tb) = out
    _same(sa, sb)
    _same(fa, fb)
    assert (na, ca, ta) == (nb, cb, tb)
    assert ca == pytest.approx(0.5, rel=1e-6)
    mean = world().allgather_array(grads).sum(0) * np.float32(1 / world().size)
    whole = mean.astype(np.float64)
    if split:  # the split parameters' slices of the tensor axis's ranks are different
        full = parts[0].flatten([np.zeros(s, np.float32) for s in sizes]).astype(np.float64)
        ours = parts[0].views(full)
        for i in (0, 2):
            ours[i][:] = parts[0].views(whole)[i]
        split_sq = world().allgather_array(np.array([ours[0] @ ours[0] + ours[2] @ ours[2]]))
        rest = whole @ whole - (ours[0] @ ours[0] + ours[2] @ ours[2])
        want = float(np.sqrt(split_sq.sum() + rest))
    else:
        want = float(np.linalg.norm(whole))
    assert na == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("experts", [False, True])
def test_tensor_parallel_clip_stays_on_the_process_groups_arrays(both, experts):
    """The torch backend's clip under tensor parallelism (the job's ranks as the tensor
    axis): over Gloo, the split parameters' squares are summed on the transport and
    every gradient scaled by a tensor coefficient, reading nothing on the host; the
    same gradients as the MPI engine's numpy sum, which the norm (computed here from
    every rank's gradients) confirms. `experts`: an expert's squares summed over its
    group (the job) on the group's transport too, also without a host read."""
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_tensor import clip_grad_norm_
    from hpctrain.moe.parallel import ExpertGroup

    mpi, pg = both
    names = ["blocks.0.ffn.fc1.weight", "blocks.0.ffn.fc2.weight", "head.weight"]
    names += ["blocks.0.moe.experts.0.fc1.weight"] if experts else []
    grads = [torch.from_numpy(_ints(20 + i, 12) / np.float32(7)) for i in range(len(names))]
    replicated = [g.clone() for g in grads]  # head: the same on every rank
    replicated[2] = torch.from_numpy(np.arange(12, dtype=np.float32) / 5)
    out = []
    for transport in (None, pg):
        params = [torch.nn.Parameter(torch.zeros(12)) for _ in names]
        for p, g in zip(params, replicated, strict=True):
            p.grad = g.clone()
        group = ExpertGroup(mpi).with_transports(transport, None) if experts else None
        groups = ModelGroups(TensorGroup(mpi, transport), group)
        with HostReads() as reads:
            clip_grad_norm_(list(zip(names, params, strict=True)), 0.25, groups)
        if transport is not None:
            assert reads.where == []
        out.append([p.grad for p in params])
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    sq = {n: float((g.double() ** 2).sum()) for n, g in zip(names, replicated, strict=True)}
    every = world().allgather_array(np.array([sq[n] for n in names]))
    split = [n for n in names if split_kind(n) is not None or "experts" in n]
    norm = np.sqrt(sum(every[:, names.index(n)].sum() for n in split) + sq["head.weight"])
    scaled = float(torch.linalg.vector_norm(out[1][2].double()))
    assert scaled == pytest.approx(0.25 / (norm + 1e-6) * np.sqrt(sq["head.weight"]), rel=1e-6)


def test_a_missing_rank_raises_naming_the_collective_and_the_rank(both):
    """Rank 0 alone in an allreduce of a short-deadline group: the wait raises, naming
    what it waited for and the rank; the others never enter it."""
    mpi, _ = both
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    late = ProcessGroupTransport(mpi, "gloo", 1.0, torch.device("cpu"), group=group)
    if mpi.rank == 0:
        with pytest.raises(CollectiveError, match=r"'lonely sum' failed on rank 0 of"):
            late.allreduce_inplace(torch.ones(4), "sum", "lonely sum")
    mpi.barrier("after the lonely sum")
    dist.destroy_process_group(group)


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_zero_steps_over_the_process_group_without_numpy(both, stage, monkeypatch):
    """The torch backend's ZeRO-1/2 over Gloo: a step (backward, reduce-scatter, clip,
    Adam on the shard, allgather) never turns a tensor into numpy, and ends where the
    same step over MPI (numpy views of the tensors) ends."""
    from hpctrain.backends.torch_zero import TorchZero

    def no_numpy(*_):
        raise AssertionError("a numpy round trip in a process-group ZeRO step")

    mpi, pg = both
    x = torch.from_numpy(_ints(6, 40).reshape(5, 8) / np.float32(10))
    results = []
    for transport in (None, pg):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        params = list(model.parameters())
        z = TorchZero(mpi, params, stage, 256, lambda ps: torch.optim.Adam(ps, lr=0.01), transport)
        if transport is not None:
            assert isinstance(z.shard_grad, torch.Tensor) and z.part.arrays is pg
            monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
        z.begin_step()
        model(x).square().sum().backward()
        z.end_backward()
        z.reduce()
        z.clip(0.1)
        z.step()
        monkeypatch.undo()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
