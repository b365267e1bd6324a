"""A training step reads nothing back to the host, for every layout a GPU rank runs in
one process: dense, ZeRO-1, -2 and -3, with clipping, gradient accumulation and bf16.

On a GPU rank each such read (`float(t)`, an `if` on a tensor, `.item()`, `.numpy()`)
makes the host wait for the device, and the GPU idles while the host queues the next
step. tests/test_gpu.py proves the step free of them on a GPU (torch's sync debug
mode); here, without one, `HostReads` (tests/host_reads.py) sees hpctrain's own reads
in the same code on CPU, over the process-group engine (Gloo's side, one rank). Found
by it: ZeRO's clip read its norm and compared the coefficient on the host every step,
and with tensor parallelism gathered the shard by a boolean mask.
Tensor parallelism's clip, which needs two ranks, is tests/mpi/test_transport.py's."""

import numpy as np
import pytest
import torch
from dump_runs import TINY_TRANSFORMER
from host_reads import PACKAGE, HostReads

from hpctrain.backends import step
from hpctrain.backends.torch import TorchBackend
from hpctrain.backends.torch_transport import ProcessGroupTransport
from hpctrain.config import Config
from hpctrain.data import benchmark_input_spec
from hpctrain.exchange.zero import ZeroPartition

LAYOUTS = {
    "dense": ["train.zero=0"],
    "dense-bf16": ["train.zero=0", "train.precision=bf16"],
    "zero1": ["train.zero=1"],
    "zero2-bf16": ["train.zero=2", "train.precision=bf16"],
    "zero3": ["train.zero=3", "train.zero_unit_mb=0.004"],
    "adam-zero2": ["train.zero=2", "optimizer.name=adam"],
}


def _backend(overrides: list[str]) -> TorchBackend:
    base = ["runtime.device=cpu", "train.allreduce=gloo", "train.clip_norm=0.01"]
    cfg = Config.load(None, [*TINY_TRANSFORMER, *base, "train.grad_accum=2", *overrides])
    return TorchBackend(cfg, None, benchmark_input_spec(cfg.data), threads=1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_step_reads_nothing_back_to_the_host(layout):
    """After a first step (which allocates), a step that counts no accuracy (the loop's
    unlogged steps) reads no value on the host; its sums are read after it. The clip
    limit is low enough that every step clips."""
    b = _backend(LAYOUTS[layout])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, (4, 16)).astype(np.int64)
    first = b.train_step([(x, x)] * 2, 1e-3)
    with HostReads() as reads:
        stats = step.train_step(b, [(x, x)] * 2, 1e-3, tally=False)
    assert reads.where == []
    assert torch.is_tensor(stats.loss_sum)  # read after the step, by the backend
    assert isinstance(first.loss_sum, float) and isinstance(first.correct, int)
    assert np.isfinite(first.loss_sum) and np.isfinite(float(stats.loss_sum))


def test_the_detector_sees_a_read_in_hpctrain():
    """The check can fail: the host floats the pipeline asks ZeroPartition for are a
    read (`float()` of the allreduced sums), named with the line that reads; so is a
    gather by a boolean mask, whose size a GPU would have to tell the host."""
    transport = ProcessGroupTransport(None, "gloo", 60.0, torch.device("cpu"))
    part = ZeroPartition(transport, [10, 6], 1, bucket_bytes=1024)
    shard = torch.ones(part.shard_len)
    with HostReads() as reads:
        part.square_sums(shard, None)
    assert len(reads.where) == 2 and all("zero.py" in w for w in reads.where)
    # a line as if in hpctrain (none of its step's code does this any more)
    gather = compile("shard[shard > 0]", f"{PACKAGE}/gather.py", "eval")
    with HostReads() as reads:
        eval(gather, {"shard": shard})
    assert reads.where == ["aten.index.Tensor at gather.py:1 in <module>"]
    with HostReads() as reads:
        coef = part.clip(shard, 0.5)  # the step's clip: the coefficient stays a tensor
    assert reads.where == [] and torch.is_tensor(coef)
    assert float(coef) == pytest.approx(0.5 / (16**0.5 + 1e-6), rel=1e-15)
