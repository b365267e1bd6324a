"""GPU ranks (marked gpu: skipped with the reason where torch sees no CUDA GPU; run on
the H100 by tools/gpu_check.sh). Single-process: the multi-rank GPU runs are the check
script's (two ranks sharing the GPU through the host-staged MPI engine)."""

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


def test_a_training_step_never_synchronises_the_host():
    import torch

    b = _backend("cuda", "train.precision=bf16", "train.grad_accum=2")
    assert b.device.type == "cuda" and b.engine == "nccl"
    batches = list(_batches(6))
    for mb in batches[:2]:  # warm-up: pinned slots and kernels are allocated here
        b.train_step(mb * 2, 1e-3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = [b.train_step(mb * 2, 1e-3) for mb in batches[2:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(np.isfinite(float(s.loss_sum)) for s in stats)  # read after the steps


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
