"""The exchange layer's local math on torch tensors equals it on numpy, and on a GPU it
never synchronises the host: every gradient compressor, on a loopback transport (a test
double standing for two ranks holding the same gradient: its collectives sum or gather
this rank's buffer twice) over the array seam of each kind. The real collectives are
tested over MPI and Gloo in tests/mpi/test_compression.py and the jobs; here only what a
rank computes by itself is, and on CUDA under torch.cuda.set_sync_debug_mode("error")
(run on a GPU by tools/gpu_check.sh; the CPU case runs everywhere)."""

import numpy as np
import pytest

from hpctrain.exchange.compression import build
from hpctrain.runtime.host_arrays import HostArrays

SHAPES = [(48, 20), (20,), (12, 6, 3), (7,)]
OPTS = {"ratio": 0.1, "rank": 3, "error_feedback": True, "warmup_steps": 1, "seed": 0}
METHODS = ["topk", "randomk", "int8", "powersgd", "fp16", "bf16"]


class _Loopback:
    """Two ranks with the same buffers: a sum doubles, a gather repeats."""

    rank, size = 0, 2

    def allreduce_inplace(self, buf, op="sum", what=""):
        if op == "sum":
            buf *= 2
        return buf

    def allgather_into(self, mine, buf, counts, what=""):
        buf[: mine.shape[0]] = mine
        buf[mine.shape[0] :] = mine
        return buf


class HostLoopback(_Loopback, HostArrays):
    pass


def _torch_loopback(device: str):
    import torch

    from hpctrain.backends.torch_arrays import TorchArrays

    class TorchLoopback(_Loopback, TorchArrays):
        pass

    loop = TorchLoopback()
    loop.device = torch.device(device)
    return loop


def _grads(step: int) -> np.ndarray:
    n = sum(int(np.prod(s)) for s in SHAPES)
    return np.random.default_rng(step).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", METHODS)
def test_a_compressor_on_the_device_equals_numpy_without_host_sync(device, method):
    import torch

    half = method in ("fp16", "bf16")  # numpy has no 16-bit sum (nor bfloat16): the
    # loopback's mean of two equal gradients is the gradient itself
    host = build("topk" if half else method, HostLoopback(), SHAPES, OPTS, "test")
    dev = build(method, _torch_loopback(device), SHAPES, OPTS, "test", ring=False)
    assert isinstance(dev.buffer, torch.Tensor) and dev.buffer.device.type == device
    for step in range(4):  # step 0: the dense warm-up (lossy); steps 1-3 compressed
        g = _grads(step)
        host.buffer[:] = g
        dev.buffer[:] = torch.from_numpy(g).to(device)
        host.reduce(step)
        if half:
            host.buffer[:] = g
        if device == "cuda" and step >= 2:  # kernels and allocations warmed up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            dev.reduce(step)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        got = dev.buffer.cpu().numpy()
        if half or method == "powersgd" or device == "cuda":
            # 16-bit rounding; QR in float64 (numpy) vs float32 (torch); GPU kernels may
            # fuse or reorder float32 arithmetic
            tol = 8e-3 if method == "bf16" else 1e-3
            np.testing.assert_allclose(got, host.buffer, rtol=tol, atol=tol, err_msg=f"{step}")
        else:
            np.testing.assert_array_equal(got, host.buffer, err_msg=f"step {step}")
        if not half:
            assert dev.stats() == host.stats()
