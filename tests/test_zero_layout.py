"""The ZeRO layout (exchange/zero.py) without MPI: every element of the padded flat
vector belongs to exactly one rank's shard, shards round-trip to the full vector, and
the segments follow the bucket plan (stage 2) or are one (stage 1)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain import Config
from hpctrain.exchange.zero import ZeroPartition
from hpctrain.models import zoo

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


# --- ZeRO-3: units, their layout, their gathers -----------------------------------------


def test_unit_plan_merges_consecutive_modules_up_to_the_unit_size():
    from hpctrain.exchange.zero import unit_plan

    # modules: a, (no parameters), b, c, (no parameters); float32 sizes per parameter
    modules = [[0, 1], [], [2], [3, 4], []]
    sizes = [100, 10, 50, 5, 200]
    # 400 bytes: a (440) is a unit; the parameter-less module joins b (200), not yet
    # full, then c (820) fills it; the trailing parameter-less module joins the last unit
    assert unit_plan(modules, sizes, 400) == [[0], [1, 2, 3, 4]]
    # 1 byte: every module with parameters closes a unit; parameter-less ones join the
    # following unit, or the last one at the end
    assert unit_plan(modules, sizes, 1) == [[0], [1, 2], [3, 4]]
    assert unit_plan([[], [0], [], [1]], [1, 1], 1) == [[0, 1], [2, 3]]
    # larger than the model: one unit
    assert unit_plan(modules, sizes, 10**6) == [[0, 1, 2, 3, 4]]
    # 600 bytes: a + b (640) is one unit, c (820) the next
    assert unit_plan(modules, sizes, 600) == [[0, 1, 2], [3, 4]]
    # what is left at the end, below the size, stays a unit of its own
    assert unit_plan([[0], [1]], [300, 1], 1000) == [[0], [1]]
    assert unit_plan([[], []], [], 1) == [[0, 1]]  # no parameters at all: one unit


UNITS = [[0, 1], [2], [3, 4, 5], [6, 7]]  # parameter indices per unit (SIZES above)


def _stage3(n, units=UNITS):
    return [
        ZeroPartition(SimpleNamespace(size=n, rank=r), SIZES, 3, 0, units=units) for r in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stage_three_segments_are_the_units_each_padded_and_owned_once(n):
    parts = _stage3(n)
    p = parts[0]
    assert [list(seg.params) for seg in p.segments] == UNITS
    for seg, unit in zip(p.segments, UNITS, strict=True):
        assert seg.length == sum(SIZES[i] for i in unit)
        assert seg.padded % n == 0 and seg.length <= seg.padded < seg.length + n
    assert p.shard_len * n == p.flat_len == sum(seg.padded for seg in p.segments)
    assert p.gathered_bytes() == 2 * 4 * max(seg.padded for seg in p.segments)
    arrays = [np.arange(s, dtype=np.float32) + 10_000 * i for i, s in enumerate(SIZES)]
    flat = p.flatten(arrays)
    shards = np.stack([q.shard_of(flat) for q in parts])
    np.testing.assert_array_equal(p.unshard(shards), flat)
    # owned_ranges: every element of every parameter in exactly one rank's shard, at
    # the place the shard holds it (what a rank writes of the parameters it owns)
    seen = [np.zeros(s, dtype=int) for s in SIZES]
    for q, shard in zip(parts, shards, strict=True):
        for i, first, at, count in q.owned_ranges():
            seen[i][first : first + count] += 1
            np.testing.assert_array_equal(shard[at : at + count], arrays[i][first : first + count])
    assert all((s == 1).all() for s in seen)
    # a unit's gather is its pieces in rank order
    for s in range(len(UNITS)):
        gathered = np.concatenate([q.shard_view(shards[q.rank], s) for q in parts])
        np.testing.assert_array_equal(gathered, p.segment_view(flat, s))


def test_stage_three_places_parameters_in_unit_order_and_needs_units():
    p = _stage3(2, [[4, 5], [0, 1, 2, 3], [6, 7]])[0]
    assert p.offsets[4] == 0 and p.offsets[0] == p.segments[1].start
    assert p.segment_of == {4: 0, 5: 0, 0: 1, 1: 1, 2: 1, 3: 1, 6: 2, 7: 2}
    with pytest.raises(ValueError, match="3 with units"):
        ZeroPartition(None, SIZES, 3, 0)
    with pytest.raises(ValueError, match="3 with units"):
        ZeroPartition(None, SIZES, 2, 8000, units=UNITS)


class _Pending:
    """A non-blocking gather that completes when waited for (the fake comm's)."""

    def __init__(self, comm, mine, buf):
        self.comm, self.mine, self.buf, self.done = comm, mine.copy(), buf, False

    def test(self):
        return self.done

    def wait(self):
        k = len(self.mine)  # rank 1's piece: this rank's, negated
        self.buf[:k], self.buf[k:] = self.mine, -self.mine
        self.done = True


class _TwoRanks:
    size, rank = 2, 0

    def __init__(self):
        self.started = []

    def start_allgather_into(self, mine, buf, counts, what):
        assert counts == [len(mine)] * 2 and len(buf) == 2 * len(mine)
        self.started.append(what)
        return _Pending(self, mine, buf)


def _gather(comm, prefetch=True, poll_s=0.0):
    from hpctrain.exchange.zero3 import UnitGather

    part = ZeroPartition(comm, SIZES, 3, 0, units=UNITS)
    shard = np.arange(part.shard_len, dtype=np.float32) + 1
    largest = max(seg.padded for seg in part.segments)
    slots = [np.full(largest, np.nan, dtype=np.float32) for _ in range(2)]

    def buffer(u):
        return slots[u % 2][: part.segments[u].padded]

    gather = UnitGather(part, shard, buffer, 2, prefetch=prefetch, poll_s=poll_s)
    return part, shard, gather, buffer


def test_unit_gather_in_one_process_fills_two_slots_and_reuses_what_they_hold():
    part, shard, g, buffer = _gather(None)
    g.need(1)
    np.testing.assert_array_equal(buffer(1), part.shard_view(shard, 1))
    g.prefetch(2)  # one process: ready at once, in the other slot
    assert g.live == {1} and g.holder == [2, 1] and g.gathers == 2
    g.need(2)
    g.prefetch(2)  # in its slot already: nothing
    assert g.gathers == 2 and g.live == {1, 2}
    g.release(1)
    assert g.live == {2} and g.holder == [2, 1]  # released, its values still there
    g.need(1)  # still in its slot: not gathered again
    assert g.gathers == 2
    g.release_all()
    assert not g.live
    g.need(0)  # shares unit 2's slot: overwrites it
    np.testing.assert_array_equal(buffer(0), part.shard_view(shard, 0))
    assert g.holder == [0, 1] and g.gathers == 3
    g.invalidate()  # the shard changed: everything is gathered afresh
    g.need(1)
    assert g.gathers == 4 and g.holder == [None, 1]
    _, _, off, _ = _gather(None, prefetch=False)
    off.prefetch(0)
    assert off.gathers == 0 and not off.live


def test_unit_gather_keeps_at_most_one_prefetch_on_its_way():
    comm = _TwoRanks()
    part, shard, g, buffer = _gather(comm)
    g.need(0)  # gathered and waited for
    mine = part.shard_view(shard, 0)
    np.testing.assert_array_equal(buffer(0), np.concatenate([mine, -mine]))
    g.prefetch(1)
    g.prefetch(2)  # unit 1's gather is still on its way: no second one
    assert comm.started == [
        "ZeRO-3 parameter allgather (unit 0)",
        "ZeRO-3 parameter allgather (unit 1)",
    ]
    assert g.live == {0} and list(g._pending) == [1]
    g.need(1)  # waits for the prefetch, starts nothing
    assert len(comm.started) == 2 and not g._pending
    mine = part.shard_view(shard, 1)
    np.testing.assert_array_equal(buffer(1), np.concatenate([mine, -mine]))
    g.prefetch(2)  # unit 0 is in use in that slot: not overwritten
    assert len(comm.started) == 2
    g.release(0)
    g.prefetch(2)
    assert len(comm.started) == 3 and list(g._pending) == [2]
    g.release_all()  # waits for unit 2's gather
    assert not g._pending and not g.live and g.holder == [2, 1]
    # bytes sent: (N-1) pieces per gather, as `comm_bytes` counts them
    assert part.take_sent() == 4 * sum(part.segments[u].piece(2) for u in (0, 1, 2))


def test_a_unit_gather_dropped_ends_its_progress_thread_and_is_freed():
    """The progress thread (MPI's gathers) holds its gather only while it tests one:
    a gather dropped after a run is freed and its thread ends (it held both for the
    life of the process before 6 Dec)."""
    import gc
    import weakref

    _, _, g, _ = _gather(_TwoRanks(), poll_s=0.0005)
    g.need(0)
    g.prefetch(1)
    thread = g._thread
    assert thread is not None and thread.is_alive()
    g.release_all()
    gone = weakref.ref(g)
    del g
    gc.collect()
    thread.join(timeout=10)
    assert gone() is None and not thread.is_alive()


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _storage(model) -> set[int]:
    """The storages the parameters point into (ZeRO-3: its two slots)."""
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_torch_zero3_in_one_process_trains_as_plain_torch_and_frees_outside_use():
    """TorchZero3 without a world (one rank): a unit per Linear (ReLU and Tanh join the
    layer after them), SGD with momentum, two micro-batches, clipping: the parameters
    equal plain torch's after every step; a unit's parameters have storage only while
    it runs: every parameter points into one of two slots, units take turns in them;
    the state functions give the
    whole parameters and take them back."""
    import copy

    import torch

    from hpctrain.backends.torch_zero3 import TorchZero3

    model = _mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    zero = TorchZero3(None, model, params, 1, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert [list(seg.params) for seg in zero.part.segments] == [[0, 1], [2, 3], [4, 5]]
    slots = {t.untyped_storage().data_ptr() for t in zero._slots}
    assert _storage(model) == slots and len(slots) == 2  # sharded from the start
    seen = []  # (layer, its weight's storage size) as its forward starts
    for i in (0, 2, 4):
        model[i].register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, m.weight.untyped_storage().size()))
        )
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        micro = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)) for _ in "ab"]
        ref_opt.zero_grad()
        for x, y in micro:
            (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        zero.begin_step()
        for x, y in micro:
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            zero.end_backward()
            assert not zero.gather.live
        zero.reduce()
        zero.clip(0.5)
        zero.step()
        assert not zero.gather.live and _storage(model) == slots
        whole = zero.all_params()
        for got, want in zip(whole, ref.parameters(), strict=True):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=0, atol=1e-6)
    assert seen and all(size > 0 for _, size in seen)  # gathered while it ran
    assert not zero.gather.live  # all_params releases what it gathered
    # two slots of the largest unit (the running and the prefetched one)
    largest = max(seg.padded * 4 for seg in zero.part.segments)
    assert zero.gathered_peak == 2 * largest
    # the state functions: one rank holds everything; a load round-trips
    root = zero.root_params()
    for a, b in zip(root, whole, strict=True):
        np.testing.assert_array_equal(a, b)
    pieces = zero.param_pieces(names)
    assert sorted(pieces) == sorted(f"model/{n}" for n in names)
    for n, w in zip(names, whole, strict=True):
        shape, first, elements = pieces[f"model/{n}"]
        assert shape == w.shape and first == 0
        np.testing.assert_array_equal(elements, w.reshape(-1))
    zero.load_params([w * 2 for w in whole])
    for a, b in zip(zero.all_params(), whole, strict=True):
        np.testing.assert_array_equal(a, b * 2)
    assert _storage(model) == slots
    with torch.no_grad():  # evaluation: gathered per unit, freed after it
        out = model(torch.ones(2, 8))
    assert out.shape == (2, 4) and _storage(model) == slots and not zero.gather.live


def test_torch_zero3_refuses_parameters_it_cannot_place_in_a_unit():
    import torch
    from torch import nn

    from hpctrain.backends.torch_zero3 import TorchZero3
    from hpctrain.errors import ConfigError

    def make(ps):
        return torch.optim.SGD(ps, lr=0.1)

    tied = _mlp()
    tied[4].weight = nn.Parameter(torch.zeros(4, 16))
    tied.add_module("head", nn.Linear(16, 4, bias=False))
    tied.head.weight = tied[4].weight  # one parameter in two layers
    with pytest.raises(ConfigError, match="tied weights"):
        TorchZero3(None, tied, list(tied.parameters()), 1, make)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()
            self.scale = nn.Parameter(torch.ones(1))  # on the model itself

    own = Scaled()
    with pytest.raises(ConfigError, match="scale is registered on the model itself"):
        TorchZero3(None, own, list(own.parameters()), 1, make)


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_zero3_state_in_one_process_is_the_plain_backends(backend):
    """Each backend with train.zero=3 at one rank, on a ResNet (residual blocks,
    BatchNorm buffers, four units): the same initial weights, the same Adam steps and
    the same canonical state as without ZeRO, in the model's order (buffers among the
    parameters); export_owned_state splits it into replicated and owned parts without
    overlap; a state imported into a fresh ZeRO-3 backend trains on identically.
    (TensorFlow runs each unit again in backward: its BatchNorm statistics must still
    move once per step.)"""
    from hpctrain.runtime import world

    if backend == "torch":
        from hpctrain.backends.torch import TorchBackend as Backend
    else:
        from hpctrain.backends.tensorflow import TensorFlowBackend as Backend

    inp = zoo.InputSpec((3, 8, 8), 4)
    base = ["model.name=resnet", "data.task=images", "model.width=4", "optimizer.name=adam"]
    base.append(f"backend={backend}")
    zero3 = [*base, "train.zero=3", "train.zero_unit_mb=0.001"]
    plain = Backend(Config.load(None, base), world(), inp, 1)
    zero = Backend(Config.load(None, zero3), world(), inp, 1)
    assert len(zero.zero.part.segments) > 2
    rng = np.random.default_rng(0)
    batches = [
        [(rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 8))]
        for _ in range(4)
    ]

    def same(a, b):
        assert list(a) == list(b)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)

    same(zero.get_weights(), plain.get_weights())
    for batch in batches[:3]:
        plain.train_step(batch, 0.01)
        zero.train_step(batch, 0.01)
    assert not zero.zero.gather.live  # sharded between steps: no unit in use
    state = zero.export_state()
    want = plain.export_state()
    same({k: v for k, v in state.items() if k.startswith("model/")},
         {k: v for k, v in want.items() if k.startswith("model/")})  # fmt: skip
    assert sorted(state) == sorted(want)
    for k in want:
        np.testing.assert_allclose(state[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    replicated, owned = zero.export_owned_state()
    assert not set(replicated) & set(owned) and sorted({**replicated, **owned}) == sorted(want)
    assert any(k.startswith("model/") and "running_mean" in k for k in replicated)
    for k, (shape, first, elements) in owned.items():  # one rank owns whole tensors
        assert first == 0 and shape == want[k].shape
        np.testing.assert_array_equal(elements, np.asarray(state[k]).reshape(-1), err_msg=k)
    again = Backend(Config.load(None, zero3), world(), inp, 1)
    again.import_state({k: np.array(v) for k, v in state.items()})
    zero.train_step(batches[3], 0.01)
    again.train_step(batches[3], 0.01)
    a, b = zero.get_weights(), again.get_weights()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
