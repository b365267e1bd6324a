"""ZeRO's device path in one process: the shard, gradient buffers (and ZeRO-3's two
slots) as tensors on the rank's device (the process-group transport's side), against
plain torch on the same device, for stages 1, 2 and 3. On CPU (Gloo's side) it runs everywhere; on CUDA (NCCL's
side, marked gpu) it runs where a GPU is, by tools/gpu_check.sh. One rank: no
collective, but every hook, slot refill, prefetch and optimizer step of the device path;
the collectives are the Gloo jobs' (tests/test_process_group_jobs.py)."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from hpctrain.backends.torch_steps import make_optimizer
from hpctrain.backends.torch_transport import ProcessGroupTransport
from hpctrain.backends.torch_zero import TorchZero
from hpctrain.backends.torch_zero3 import TorchZero3

ADAM = {"name": "adam", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # four Linear layers: one unit each (units of 1 byte), sharing two slots
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def _batches(steps: int):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        yield (
            torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 5, 8)),
        )


def _zero(stage: int, model: nn.Module, transport, dev, offload="none"):
    params = list(model.parameters())
    make_opt = lambda p, **kw: make_optimizer(ADAM, p, **kw)  # noqa: E731
    if stage == 3:  # units of 1 byte: one per Linear, four units sharing two slots
        return TorchZero3(
            None, model, params, 1, make_opt, transport=transport, device=dev, offload=offload
        )
    return TorchZero(None, params, stage, 1024, make_opt, transport, offload)


@pytest.mark.parametrize(
    "stage, offload",
    [(1, "none"), (2, "none"), (3, "none"), (1, "optimizer"), (2, "optimizer"),
     (3, "optimizer"), (3, "optimizer+params")],
)  # fmt: skip
@pytest.mark.parametrize("device", DEVICES)
def test_zero_on_the_device_equals_plain_training_on_it(device, stage, offload):
    """train.offload=optimizer: the master shard and Adam's slots in (pinned) host
    memory, updated by the CPU, the device's shard rewritten after each update: the
    same training (on CUDA against the device's fused Adam, within its rounding).
    optimizer+params (ZeRO-3): the shard itself on the host, staged for each gather."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(device)
    plain = _model().to(dev)
    sharded = copy.deepcopy(plain)
    opt = make_optimizer(ADAM, list(plain.parameters()))
    engine = "nccl" if device == "cuda" else "gloo"
    transport = ProcessGroupTransport(None, engine, 60.0, dev)  # one rank: no group
    zero = _zero(stage, sharded, transport, dev, offload)
    host = "cpu" if offload != "none" else device
    assert zero.shard.device.type == (host if offload == "optimizer+params" else device)
    assert zero.opt.param.device.type == host
    if offload != "none" and device == "cuda":
        assert zero.opt.param.is_pinned()
    if offload == "optimizer+params":
        assert zero.opt.param is zero.shard and zero._staging[0].device.type == device
    if stage == 3:
        assert all(s.device.type == device for s in zero._slots)
        assert len(zero.part.segments) == 4
    loss_fn = nn.CrossEntropyLoss()
    for x, y in _batches(5):
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        loss_fn(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
        zero.begin_step()
        loss_fn(sharded(x), y).backward()
        zero.end_backward()
        zero.reduce()
        zero.clip(0.5)
        zero.step()
    got = (
        zero.all_params()
        if stage == 3
        else [p.detach().cpu().numpy() for p in sharded.parameters()]
    )
    names = [n for n, _ in plain.named_parameters()]
    for name, p, g in zip(names, plain.parameters(), got, strict=True):
        np.testing.assert_allclose(g, p.detach().cpu().numpy(), rtol=0, atol=1e-6, err_msg=name)
    slots = zero.optimizer.state[zero.opt.param]
    assert all(v.device.type == host for v in slots.values() if v.dim() > 0)
    offloaded = zero.memory(2)["mem_offloaded_bytes"]
    assert offloaded == (4 * zero.part.shard_len * 4 if offload != "none" else 0)
    if stage == 3:
        assert zero.gather.gathers > 4 * 5  # units gathered again after each step
        largest = max(s.padded for s in zero.part.segments)
        assert zero.memory(2)["zero_gathered_peak_bytes"] == 2 * largest * 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_step_path_feeds_its_micro_batches_through_the_device_feeder(stage):
    """The replicated and the ZeRO steps both hand each micro-batch to the rank's
    DeviceFeeder (on a GPU rank the only way onto the device; found on an H100 when the
    ZeRO step bypassed it and the batches stayed on the host)."""
    from hpctrain.backends.torch import TorchBackend
    from hpctrain.config import Config
    from hpctrain.models import zoo

    cfg = Config.load(
        "configs/demo.yaml",
        ["runtime.device=cpu", "train.allreduce=mpi", f"train.zero={stage}", "train.grad_accum=2"],
    )
    backend = TorchBackend(cfg, None, zoo.InputSpec(shape=(32,), classes=10), threads=1)
    fed, put = [], backend._feed.put
    backend._feed.put = lambda array: fed.append(array) or put(array)
    rng = np.random.default_rng(0)
    micro = [
        (rng.standard_normal((8, 32)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(2)
    ]
    backend.train_step(micro, 1e-3)
    assert [id(a) for a in fed] == [id(a) for pair in micro for a in pair]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_process_group_backend_without_a_communicator_keeps_zero_on_its_device(stage):
    """One process (no MPI communicator: the GPU memory-plan test, a library user) on the
    process-group engine still gets a one-rank transport, so ZeRO's buffers are tensors
    of the device, never numpy views (which a CUDA tensor cannot give: found by reading,
    before the plan test first ran on a GPU). ZeRO-3's zoo model is built without memory
    on the backend's device itself (the next test)."""
    from dump_runs import TINY_TRANSFORMER

    from hpctrain.backends.torch import TorchBackend
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec

    overrides = [*TINY_TRANSFORMER, "runtime.device=cpu", "train.allreduce=gloo"]
    cfg = Config.load(None, [*overrides, f"train.zero={stage}", "train.zero_unit_mb=0.004"])
    inp = benchmark_input_spec(cfg.data)
    backend = TorchBackend(cfg, None, inp, threads=1)
    assert torch.is_tensor(backend.zero.shard_grad)
    x = np.zeros((4, *inp.shape), np.int64)
    backend.train_step([(x, x)], 1e-3)


def test_zero3s_memory_less_model_is_made_on_the_device_it_runs_on():
    """ZeRO-3's zoo model is built without memory on the rank's device, so that moving
    the model there copies nothing (a copy to CUDA would read a 0-byte storage); the
    meta device stands in for a GPU here."""
    from dump_runs import TINY_TRANSFORMER

    from hpctrain.backends.torch_model import build_model
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec

    cfg = Config.load(None, TINY_TRANSFORMER)
    inp = benchmark_input_spec(cfg.data)
    lazy = build_model(cfg.model, inp, 0, lazy_on=torch.device("meta"))
    params = list(lazy.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)


@pytest.mark.parametrize(
    "stage, engine", [(0, "mpi"), (0, "overlap"), (1, "mpi"), (2, "mpi"), (3, "mpi"), (3, "gloo")]
)
def test_a_backend_dropped_after_its_steps_is_freed(stage, engine):
    """Nothing outlives a run's backend once it is dropped: hooks on parameters live in
    torch's C++ autograd state, where a hook bound to its engine made a cycle Python's
    collector cannot see (found 6 Dec: every ZeRO-3 run kept its model, 900 MiB for 50 M
    parameters, for the life of the process; a second run in one process held both)."""
    import gc
    import weakref

    from dump_runs import TINY_TRANSFORMER

    from hpctrain.backends.torch import TorchBackend
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec

    sets = [*TINY_TRANSFORMER, "runtime.device=cpu", f"train.allreduce={engine}"]
    sets += [f"train.zero={stage}", "train.zero_unit_mb=0.004"]
    cfg = Config.load(None, sets)
    inp = benchmark_input_spec(cfg.data)
    backend = TorchBackend(cfg, None, inp, threads=1)
    x = np.zeros((4, *inp.shape), np.int64)
    backend.train_step([(x, x)], 1e-3)
    gone = [weakref.ref(backend), weakref.ref(next(backend.model.parameters()))]
    del backend
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
