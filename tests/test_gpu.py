"""GPU ranks (marked gpu: skipped with the reason where torch sees no CUDA GPU; run on
the H100 by tools/gpu_check.sh). Single-process: the multi-rank GPU runs are the check
script's (two ranks sharing the GPU through the host-staged MPI engine)."""

import math

import numpy as np
import pytest

from hpctrain.config import Config
from hpctrain.models import zoo

pytestmark = pytest.mark.gpu

MLP = [
    "model.hidden=[256, 256]",
    "train.batch_size=64",
    "train.clip_norm=1.0",
    "optimizer.name=adam",
]


def _backend(device: str, *overrides: str):
    from hpctrain.backends.torch import TorchBackend

    engine = "train.allreduce=mpi" if device == "cpu" else "train.allreduce=auto"  # no Horovod
    cfg = Config.load("configs/demo.yaml", [f"runtime.device={device}", engine, *MLP, *overrides])
    inp = zoo.InputSpec(shape=(32,), classes=10)
    return TorchBackend(cfg, None, inp, threads=2)


def _batches(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((64, 32)).astype(np.float32)
        y = rng.integers(0, 10, 64).astype(np.int64)
        yield [(x, y)]


SYNC_FREE = {  # every layout one GPU rank runs; clip_norm=1.0 (MLP) in each
    "dense-bf16": ["train.precision=bf16"],
    "dense-fp16-sgd": ["train.precision=fp16", "optimizer.name=sgd"],
    "zero1-bf16": ["train.precision=bf16", "train.zero=1"],
    "zero2-bf16": ["train.precision=bf16", "train.zero=2"],
    "zero3-bf16": ["train.precision=bf16", "train.zero=3", "train.zero_unit_mb=0.1"],
}


@pytest.mark.parametrize("layout", sorted(SYNC_FREE))
def test_a_training_step_never_synchronises_the_host(layout, monkeypatch):
    """fp16 with SGD: torch's loss scaler reads the overflow flag on the host unless the
    optimizer is fused (hpctrain fuses SGD on GPUs). ZeRO: the clip's norm and
    coefficient stay on the device (tests/test_host_reads.py is the CPU side)."""
    import torch

    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")  # ZeRO on GPU ranks: gated
    b = _backend("cuda", "train.grad_accum=2", *SYNC_FREE[layout])
    assert b.device.type == "cuda" and b.engine == "nccl"
    batches = list(_batches(6))
    for mb in batches[:2]:  # warm-up: pinned slots and kernels are allocated here
        b.train_step(mb * 2, 1e-3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the loop's unlogged steps count no correct predictions (tally=False)
        stats = [b.train_step(mb * 2, 1e-3, tally=i % 2 == 0) for i, mb in enumerate(batches[2:])]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(np.isfinite(float(s.loss_sum)) for s in stats)  # read after the steps
    assert [np.isnan(float(s.correct)) for s in stats] == [False, True, False, True]


def test_fp16_sgd_trains_on_after_its_first_step_overflowed():
    """The loss scaler skips an overflowed first step inside torch's fused SGD kernel,
    which left its momentum uninitialised (NaN under train.deterministic): hpctrain
    makes it zeros first (torch_steps.make_sgd; tests/test_devices.py on the CPU)."""
    b = _backend("cuda", "train.precision=fp16", "optimizer.name=sgd", "train.deterministic=true")
    ((x, y),) = next(_batches(1))
    before = b.get_weights()
    b.train_step([(x * 1e6, y)], 1e-3)  # inf in fp16: every gradient overflows
    for key, value in b.get_weights().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)  # skipped
    stats = [b.train_step(mb, 1e-3) for mb in _batches(3, seed=1)]
    assert all(np.isfinite(float(s.loss_sum)) for s in stats)
    assert all(np.isfinite(v).all() for v in b.get_weights().values())


def test_host_arrays_reach_the_gpu_without_a_host_wait():
    """MoE routing plans and random-k's indices cross through pinned memory
    (torch_device.to_device): the host queues the copy and goes on."""
    import torch

    from hpctrain.backends.torch_device import to_device

    device = torch.device("cuda")
    to_device(np.arange(1000), device)  # warm-up: the pinned allocator's first block
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [to_device(np.arange(k, k + 1000), device) for k in range(4)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [int(t[0]) for t in got] == [0, 1, 2, 3]


def test_batches_reach_the_gpu_through_reused_pinned_slots_without_a_host_read():
    """DeviceFeeder: each batch is copied into a reused pinned slot and on to the GPU
    without a host wait, and filling the slot is no host read of a tensor (every GPU
    run of tests/test_gpu_jobs.py watches its steps for those: tests/scripts/step_reads.py;
    on CPU ranks the feeder hands numpy's memory over as it is)."""
    import torch
    from host_reads import HostReads

    from hpctrain.backends.torch_device import DeviceFeeder

    feeder = DeviceFeeder(torch.device("cuda"))
    batches = [np.full((64, 32), k, dtype=np.float32) for k in range(2 * feeder.depth)]
    for x in batches[: feeder.depth]:  # warm-up: each slot's pinned block is allocated
        feeder.put(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HostReads() as reads:
            got = [feeder.put(x) for x in batches[feeder.depth :]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reads.where == []
    assert [float(t.mean()) for t in got] == [float(k) for k in range(feeder.depth, len(batches))]


@pytest.mark.parametrize(
    "precision", [["train.precision=bf16"], ["train.precision=fp16", "optimizer.name=sgd"]]
)
def test_an_async_save_copies_a_gpu_ranks_state_beside_the_next_step(tmp_path, precision):
    """Issue 27 item 6: the staged export queues the state's copy into pinned buffers
    and returns without a host wait; the next step runs at once (its update ordered
    after the copy on the GPU); the save's thread waits for the copy, and the file
    holds the state of the step the save was taken at, fused Adam's step count and
    fp16's loss scale (both kept on the GPU) included. The copy stream is held back by
    a sleeping kernel, so an update not ordered after the copies would be seen."""
    import threading

    import torch

    from hpctrain.checkpoint import Checkpointer, CheckpointPolicy, load

    b = _backend("cuda", *precision)  # Adam (fused on the GPU) unless SGD
    batches = list(_batches(4))
    for mb in batches[:2]:
        b.train_step(mb, 1e-3)
    b.export_state(staged=True)  # warm-up: the mirror's pinned buffers are allocated
    b.wait_exported()
    expected = {k: np.array(v) for k, v in b.export_state().items()}
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "async": True}))
    stepped = threading.Event()

    def ready():  # the save's thread: only once the next step was queued
        assert stepped.wait(60)
        b.wait_exported()

    torch.cuda.synchronize()
    with torch.cuda.stream(b._mirror.stream):
        torch.cuda._sleep(2**30)  # ~0.5 s: the copies queue behind it
    torch.cuda.set_sync_debug_mode("error")
    try:
        state = b.export_state(staged=True)
        assert b.hold_exported_state(ck.fence)
        ck.save(2, state, {"step": 2}, private=True, defer_copy=True, ready=ready)
        b.train_step(batches[2], 1e-3)  # changes every tensor it exported
    finally:
        torch.cuda.set_sync_debug_mode("default")
        stepped.set()
    saved = load(ck.wait()).state
    after = b.export_state()
    assert all(not np.array_equal(after[k], expected[k]) for k in expected if k.endswith("weight"))
    assert sorted(saved) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(saved[key], expected[key], err_msg=key)
    if "optimizer/step" in saved:
        assert int(saved["optimizer/step"]) == 2 and int(after["optimizer/step"]) == 3
    else:
        assert float(saved["optimizer/loss_scale"]) > 1


def test_gpu_state_resumes_on_a_cpu_rank_and_back_with_the_same_values():
    gpu = _backend("cuda")
    for mb in _batches(3):
        gpu.train_step(mb, 1e-3)
    state = {k: np.array(v) for k, v in gpu.export_state().items()}
    cpu = _backend("cpu")
    cpu.import_state(state)
    for key, value in cpu.export_state().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    again = _backend("cuda")
    again.import_state(cpu.export_state())
    for key, value in again.export_state().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    # and trains on: the fused Adam reads its imported step count on the device
    steps = [again.train_step(mb, 1e-3) for mb in _batches(1, seed=1)]
    step = again.optimizer.state[again._dense[0]]["step"]
    assert step.device.type == "cuda" and int(step) == 4, step
    assert np.isfinite(float(steps[0].loss_sum))


def test_gpu_steps_follow_the_cpu_math():
    """fp32 on the GPU vs the CPU from the same weights and batches: the same training
    within float32 rounding of different kernels (TF32 off)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu, gpu = _backend("cpu"), _backend("cuda")
    for mb in _batches(4):
        cpu.train_step(mb, 1e-3)
        gpu.train_step(mb, 1e-3)
    a, b = cpu.get_weights(), gpu.get_weights()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-5, err_msg=key)


def test_memory_figures_come_from_the_cuda_allocator():
    b = _backend("cuda")
    stats = b.train_step(next(_batches(1)), 1e-3)
    assert stats.extra["mem_cuda_peak_allocated_bytes"] >= stats.extra["mem_param_bytes"]
    assert (
        stats.extra["mem_cuda_peak_reserved_bytes"] >= stats.extra["mem_cuda_peak_allocated_bytes"]
    )


# the 50 M-parameter transformer of the CPU memory tests (tests/test_memory_plan_jobs.py)
BIG = [
    "model.name=transformer", "data.task=tokens", "model.d_model=1024", "model.n_heads=8",
    "model.d_ff=4096", "model.n_layers=4", "data.seq_len=16", "data.vocab=64",
    "train.batch_size=4", "optimizer.name=adam", "runtime.device=cuda",
]  # fmt: skip


# bf16: autocast's dtypes and weight copies, traced on fake CPU tensors (CPU autocast's
# op lists, not CUDA's: the case measures the difference); at 512 tokens the plan's
# fused attention (no 512 x 512 scores) against the allocator's; with a vocabulary of
# 16,384 the loss's logits and their gradients (4 x 1,024 tokens: 0.25 GiB a copy)
BF16_LONG = ("train.precision=bf16", "data.seq_len=512")
BF16_VOCAB = ("train.precision=bf16", "data.seq_len=1024", "data.vocab=16384")


@pytest.mark.parametrize(
    "stage, offload, more",
    [
        (0, "none", ()),
        (1, "none", ()),
        (2, "none", ()),
        (3, "none", ()),
        (2, "optimizer", ()),
        (3, "optimizer", ()),
        (3, "optimizer+params", ()),
        (0, "none", BF16_LONG),
        (3, "none", BF16_LONG),
        (0, "none", BF16_VOCAB),
    ],  # fmt: skip
)
def test_the_gpu_plan_matches_the_cuda_allocators_peak(stage, offload, more, monkeypatch):
    """The plan a GPU rank checks before its model exists (exchange/memory_plan.py with
    gpu=True, offload subtracted) against the CUDA allocator's peak over three steps of
    one process: within 10% (the CPU suite's bound for host RSS)."""
    import gc

    import torch

    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch import TorchBackend
    from hpctrain.backends.torch_plan import plan_stages
    from hpctrain.data import benchmark_input_spec

    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")  # ZeRO on GPU ranks: gated
    cfg = Config.load(None, [*BIG, f"train.zero={stage}", f"train.offload={offload}", *more])
    inp = benchmark_input_spec(cfg.data)
    _, plans, _ = plan_stages(cfg, inp, ModelGroups(), 1, (stage,), gpu=True)
    # cuBLAS's workspaces (one per thread and stream: the forward's and autograd's) are
    # not model memory: allocated here, before `base`, as earlier tests in the file do
    w = torch.ones(64, 64, device="cuda", requires_grad=True)
    (w @ w).sum().backward()
    del w
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    b = TorchBackend(cfg, None, inp, threads=2)
    x = np.zeros((4, *inp.shape), np.int64)
    for _ in range(3):
        b.train_step([(x, x)], 1e-3)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    planned = plans[stage]["total"]
    terms = {k: round(v / 2**20) for k, v in plans[stage].items()}
    del b
    gc.collect()
    assert planned == pytest.approx(peak, rel=0.10), (peak / 2**20, terms)


def test_a_model_too_big_for_the_gpu_is_refused_before_it_is_built(tmp_path):
    """Twice the GPU's memory of model state at ZeRO-0 (each layer of d_model 8192 holds
    805 M parameters, 12.9 GB with Adam's slots: 14 layers on an 80 GB H100, 24 on a
    141 GB H200): refused from the plan, on fake tensors, naming the GPU and its
    free memory, before a byte is allocated."""
    import torch
    from mpirun import PYTHON, mpirun

    layers = max(8, math.ceil(2 * torch.cuda.get_device_properties(0).total_memory / 12.9e9))
    huge = ["model.d_model=8192", "model.n_heads=64", "model.d_ff=32768"]
    huge.append(f"model.n_layers={layers}")
    # the module, not the console script: the check installs with pip --target, whose
    # scripts are not beside the machine's Python
    args = [PYTHON, "-m", "hpctrain", "train", "--run-dir", str(tmp_path / "run")]
    for o in [*BIG, *huge, "train.max_steps=1", "checkpoint.enabled=false"]:
        args += ["--set", o]
    job = mpirun(1, *args, timeout=120)
    assert job.returncode != 0, job.output
    assert "the model will not fit on the GPU" in job.output, job.output
    assert "free for this rank on cuda:0" in job.output and "train.zero=3" in job.output
    assert "Traceback" not in job.output
