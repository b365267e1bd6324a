"""`train.allreduce=gloo` under real mpirun: torch.distributed bootstrapped over MPI (no
MASTER_ADDR), the same device-side code GPU ranks run with NCCL, gives the parameters
and losses of the MPI engine after the steps (SGD with momentum and Adam, clipping,
accumulation) at np 2 and 4. The runs share the overlap tests' launches. ZeRO-1, ZeRO-2
and ZeRO-3 over Gloo (the partition, and ZeRO-3's slots and gathers, on torch tensors)
equal one process on the MPI engine, and their checkpoints resume as plain data
parallelism.

Tolerance: 1e-6, except Adam at np=4. There Gloo and Open MPI sum four ranks' gradients
in different orders, and Adam divides each update by sqrt(v): a last-bit difference in
a near-zero gradient element becomes ~2e-6 in that weight (measured: 1 of 2,048
elements of one matrix). At np=2 the sums are the same additions and the runs agree bit
for bit; with SGD at np=4 within 1e-6.
"""

import json

import pytest
from test_overlap_jobs import COMMON, TORTURE
from test_resume_jobs import BASE
from test_trainer_jobs import _assert_same_weights, _train_many, share, shared_run

CASES = [(2, "sgd", 1e-6), (4, "sgd", 1e-6), (4, "adam", 1e-5)]
# The MPI-engine runs test_overlap_jobs already trains (same options) are not repeated.
MPI_RUN = {(2, "sgd"): "engine-mpi-sgd", (4, "sgd"): "pg-mpi-sgd", (4, "adam"): "engine-mpi-adam"}
for _np, _optimizer, _ in CASES:
    _opts = [f"optimizer.name={_optimizer}", *COMMON, *TORTURE]
    if _optimizer == "sgd":
        _opts.append("optimizer.momentum=0.9")
    share(_np, "torch", f"pg-gloo-{_optimizer}", *_opts, "train.allreduce=gloo")
    if MPI_RUN[_np, _optimizer].startswith("pg-"):
        share(_np, "torch", MPI_RUN[_np, _optimizer], *_opts, "train.allreduce=mpi")


@pytest.mark.parametrize("np_, optimizer, tol", CASES)
def test_gloo_process_group_equals_the_mpi_engine(tmp_path_factory, np_, optimizer, tol):
    mpi, mpi_losses = shared_run(tmp_path_factory, np_, "torch", MPI_RUN[np_, optimizer])
    pg, pg_losses = shared_run(tmp_path_factory, np_, "torch", f"pg-gloo-{optimizer}")
    assert mpi_losses and len(pg_losses) == len(mpi_losses)
    _assert_same_weights(pg, mpi, tol)
    assert pg_losses == pytest.approx(mpi_losses, abs=tol)


# ZeRO-1/2 on the process-group engine: shard, gradients and collectives stay torch
# tensors (backends/torch_transport.py). Adam at a usual lr (see test_zero_jobs.py),
# clipped by the global norm, two micro-batches, ~4 KB segments (stage 2 reduces several
# during backward), weight decay.
ZERO_PG_JOB = [
    *BASE,
    "backend=torch",
    "model.hidden=[64, 32]",
    "optimizer.name=adam",
    "optimizer.lr=0.003",
    "optimizer.weight_decay=0.01",
    "train.grad_accum=2",
    "train.clip_norm=0.05",
    "train.bucket_mb=0.004",
]


def test_gloo_zero_equals_one_process_and_its_checkpoint_resumes_as_plain(tmp_path):
    """6 steps of train.zero=1 and train.zero=2 over Gloo at np 2 (global batch 32)
    equal one process on the MPI engine; each step sends what reduce-scatter plus
    allgather send; the ZeRO-2 run's step-6 checkpoint continues as plain data
    parallelism (mpi engine, np 2) for 3 more steps equal to one process's own
    continuation, and that process's checkpoint continues as ZeRO-1 over Gloo equal too
    (the optimizer state loaded into the process group's shard)."""
    six = [*ZERO_PG_JOB, "train.max_steps=6"]

    def then(source, *overrides):
        ckpt = tmp_path / f"{source}.npz.run" / "checkpoints" / "ckpt-00000006.h5"
        return [*ZERO_PG_JOB, "train.max_steps=9", f"checkpoint.resume={ckpt}", *overrides]

    one = _train_many(
        tmp_path,
        1,
        {
            "ref": [*six, "train.batch_size=16", "train.allreduce=mpi"],
            "ref-cont": then("ref", "train.batch_size=16", "train.allreduce=mpi"),
        },
    )
    gloo = ["train.batch_size=8", "train.allreduce=gloo"]
    two = _train_many(
        tmp_path,
        2,
        {
            "zero1": [*six, *gloo, "train.zero=1"],
            "zero2": [*six, *gloo, "train.zero=2"],
            # ZeRO-3: shard, slots and gradient buffers torch tensors, ~4 KB units
            "zero3": [*six, *gloo, "train.zero=3", "train.zero_unit_mb=0.004"],
            "zero3-mpi": [*six, "train.batch_size=8", "train.zero=3", "train.zero_unit_mb=0.004"],
            "zero2-then-plain": then("zero2", "train.batch_size=8", "train.allreduce=mpi"),
            "zero3-then-plain": then("zero3", "train.batch_size=8", "train.allreduce=mpi"),
            "plain-then-zero1": then("ref", *gloo, "train.zero=1"),
        },
    )
    ref, ref_losses = one["ref"]
    # stage 2 reduce-scatters each micro-batch; stage 3 gathers as on the MPI engine
    for stage, times in ((1, 2), (2, 3), (3, None)):
        weights, losses = two[f"zero{stage}"]
        _assert_same_weights(weights, ref, 1e-6)
        assert len(losses) == 6 and losses == pytest.approx(ref_losses, abs=1e-6)
        steps = [x for x in _metrics(tmp_path / f"zero{stage}.npz.run") if x["event"] == "step"]
        psi = steps[-1]["zero_model_param_bytes"]
        if times is not None:
            assert steps[-1]["comm_bytes"] == pytest.approx(times * psi / 2, rel=0.01)
        else:  # the same units gathered (a unit still in its slot is not) and reduced
            mpi = [x for x in _metrics(tmp_path / "zero3-mpi.npz.run") if x["event"] == "step"]
            assert [x["comm_bytes"] for x in steps] == [x["comm_bytes"] for x in mpi]
            assert steps[-1]["comm_bytes"] > 2 * psi / 2  # gathers besides reduce-scatters
    for name in ("zero2-then-plain", "zero3-then-plain", "plain-then-zero1"):
        cont, cont_losses = two[name]
        _assert_same_weights(cont, one["ref-cont"][0], 1e-6)
        assert len(cont_losses) == 3
        assert cont_losses == pytest.approx(one["ref-cont"][1], abs=1e-6)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]


# The lossy compressors on the process-group engine: the same compressor code, its
# buffers, residuals and warm-start factors torch tensors on the rank's device.
COMPRESSED = [
    *BASE,
    "backend=torch",
    "train.max_steps=9",
    "checkpoint.every_steps=6",
    "compression.ratio=0.05",
    "compression.rank=2",
    "compression.warmup_steps=1",
]
LOSSY = ["topk", "randomk", "int8", "powersgd"]


def test_gloo_compressors_equal_the_mpi_engines_and_resume_with_their_residuals(tmp_path):
    """9 steps at np 2 through each lossy compressor with error feedback: over Gloo (on
    torch tensors) the weights and losses equal the MPI engine's (numpy) within 1e-6
    (PowerSGD: 1e-5, numpy's QR runs in float64, torch's in float32); the top-k and
    PowerSGD runs over Gloo resumed from their step-6 checkpoints (residuals, PowerSGD's
    factors, the step count) end where the uninterrupted runs end. fp16 and bf16 over
    Gloo (the library's 16-bit allreduce, not the MPI engine's ring: other roundings)
    stay within 16-bit rounding of the ring's runs."""
    runs = {
        f"{m}-{e}": [*COMPRESSED, f"train.compression={m}", f"train.allreduce={e}"]
        for m in [*LOSSY, "fp16", "bf16"]
        for e in ("mpi", "gloo")
    }
    for m in ("topk", "powersgd"):
        ckpt = tmp_path / f"{m}-gloo.npz.run" / "checkpoints" / "ckpt-00000006.h5"
        runs[f"{m}-gloo-resumed"] = [*runs[f"{m}-gloo"], f"checkpoint.resume={ckpt}"]
    got = _train_many(tmp_path, 2, runs)
    for m in LOSSY:
        tol = 1e-5 if m == "powersgd" else 1e-6
        (gloo, gloo_losses), (mpi, mpi_losses) = got[f"{m}-gloo"], got[f"{m}-mpi"]
        _assert_same_weights(gloo, mpi, tol)
        assert len(gloo_losses) == 9 and gloo_losses == pytest.approx(mpi_losses, abs=tol)
        steps = [x for x in _metrics(tmp_path / f"{m}-gloo.npz.run") if x["event"] == "step"]
        assert steps[-1]["compression_ratio"] > 1.5, m
    for m, tol in (("fp16", 2e-3), ("bf16", 1e-2)):
        (gloo, gloo_losses), (ring, ring_losses) = got[f"{m}-gloo"], got[f"{m}-mpi"]
        _assert_same_weights(gloo, ring, tol)
        assert gloo_losses == pytest.approx(ring_losses, abs=tol)
        steps = [x for x in _metrics(tmp_path / f"{m}-gloo.npz.run") if x["event"] == "step"]
        assert steps[-1]["compression_ratio"] == pytest.approx(2.0), m
    for m in ("topk", "powersgd"):
        resumed, losses = got[f"{m}-gloo-resumed"]
        _assert_same_weights(resumed, got[f"{m}-gloo"][0], 1e-7)
        assert losses == pytest.approx(got[f"{m}-gloo"][1][6:], abs=1e-7)
