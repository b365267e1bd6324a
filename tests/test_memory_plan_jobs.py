"""The memory plan (`hpctrain plan-memory`, exchange/memory_plan.py) against the peak
resident memory real runs reach, under real mpirun: for ZeRO 0, 1, 2 and 3, a ~50 M
parameter transformer (Adam, float32) at np 2, the plan within 10% of the measured peak.
A run's peak is its own (loop.prepare_process: the heap trimmed, the high-water mark
reset; the warm ranks collect what each launch left), so the ZeRO stages run on the
suite's warm ranks. GPipe's case measures the heap's own high-water mark and has processes of its
own, where its margin was measured (on warm ranks, 6 Dec: its peak 18% over its plan,
the heap fragmented by earlier runs, against 6-10% in fresh processes).

Measured here (MiB, rank 0, peak RSS vs plan, three runs on 28 Nov, torch's fused
Adam): plain 1,429-1,446 vs 1,398-1,400; ZeRO-1 1,568-1,586 vs 1,495-1,497; ZeRO-2
1,013-1,018 vs 981-982; ZeRO-3 1,023-1,031 vs 983 (4-5%).

ZeRO-3's excess is glibc's heap keeping freed blocks: hpctrain sets glibc to keep freed
memory below 32 MiB for speed (runtime/allocator.py), and ZeRO-3 frees and reallocates
blocks of many sizes (parameter gradients, reduce-scatter pieces), so the heap's
high-water mark stays above the live memory the plan counts. With
MALLOC_MMAP_THRESHOLD_=4194304 (blocks over 4 MiB go back to the kernel when freed) the
peak is 988-989 MiB, within 1% of the plan (no longer a case of the suite since 6 Dec:
the pipeline's 1F1B case below runs that way). (Before Adam was fused, its step's
temporaries made ZeRO-3's excess 7-12%, and the test allowed it 15%.)
"""

from __future__ import annotations

import json

import pytest
from mpirun import HPCTRAIN, mpirun
from test_memory_limit_jobs import MODEL as LIMIT_MODEL

MIB = 1 << 20
MODEL = LIMIT_MODEL  # the 50 M transformer (Adam), 3 steps, MPI engine, no checkpoints


def _plan(stage: int, np_: int, overrides=()) -> dict:
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_plan import plan_shape
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.exchange.memory_plan import plan_stage

    cfg = Config.load(None, [*MODEL, f"train.zero={stage}", *overrides])
    t = cfg.train
    inp = benchmark_input_spec(cfg.data)
    shape = plan_shape(cfg.model, inp, ModelGroups(), t["batch_size"], precision=t["precision"])
    unit, bucket = int(t["zero_unit_mb"] * MIB), int(t["bucket_mb"] * MIB)
    return plan_stage(shape, np_, stage, cfg.optimizer, unit, bucket)


RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}  # allocator.py honours it


def _events(run, overrides, env, fresh=False) -> list[dict]:
    """metrics.jsonl of a 2-rank training run (`fresh`: in processes of its own)."""
    args = [HPCTRAIN, "train", "--run-dir", str(run)]
    for o in overrides:
        args += ["--set", o]
    job = mpirun(2, *args, timeout=300, env=env, fresh=fresh)
    assert job.returncode == 0, job.output
    return [json.loads(x) for x in (run / "metrics.jsonl").open()]


# Activation checkpointing on a model whose activations dominate (batch 8 x 128 tokens of
# d_model 512): the plan counts each block's saved input plus the block backward
# recomputes (torch_plan._recompute_bytes). Measured 5 Dec (4 blocks): peak 767 MiB vs
# plan 725 at batch 8, 929-937 vs 863 at batch 16 (6-7%); without the recompute term the
# plan was 598 and 610 (21% and 34% low).
RECOMPUTED = [
    "model.d_model=512",
    "model.d_ff=2048",
    "data.seq_len=128",
    "train.batch_size=8",
    "model.checkpoint_activations=true",
]

BF16 = ["train.precision=bf16"]


@pytest.mark.parametrize(
    "stage, env, tol, more",
    [
        (0, None, 0.10, ()),
        (1, None, 0.10, ()),
        (2, None, 0.10, ()),
        (3, None, 0.10, ()),
        (0, None, 0.10, RECOMPUTED),
        (0, None, 0.10, BF16),
        (3, None, 0.10, BF16),
    ],
    ids=["0", "1", "2", "3", "0-checkpointed-activations", "0-bf16", "3-bf16"],
)
def test_the_plan_matches_the_measured_peak(tmp_path, stage, env, tol, more):
    steps = _events(tmp_path / "run", [*MODEL, f"train.zero={stage}", *more], env)
    steps = [x for x in steps if x["event"] == "step"]
    peak = max(x["mem_peak_rss_bytes"] for x in steps)
    planned = steps[-1]["mem_rss_before_model_bytes"] + _plan(stage, 2, more)["total"]
    print(f"ZeRO-{stage}: peak RSS {peak / MIB:,.0f} MiB, plan {planned / MIB:,.0f} MiB")
    assert planned == pytest.approx(peak, rel=tol), (peak / MIB, planned / MIB)


# --- a gathered checkpoint on rank 0 ---------------------------------------------------------
# An async save (every step) gathers or copies the whole state (578 MiB here) on rank 0,
# beside its training memory (strategies/checkpoint_memory.py). Measured (MiB, rank 0,
# 29 Nov): ZeRO-3 peak RSS 1,578 against 1,025 without checkpoints (+553); plain 1,754
# against 1,452 (+300: the copy reuses heap a step frees), so there one planned copy is
# above the peak: by 14.5-15.3% (fresh processes 29 Nov and 6 Dec, warm ranks 6 Dec),
# held to 20%. The plain case (12 s) is in `make test-extended`: its copy is the same
# planned term as ZeRO-3's (model_state_bytes), which `make test` holds to 10%.
SAVING = ["checkpoint.enabled=true", "checkpoint.async=true", "checkpoint.every_steps=1"]


@pytest.mark.parametrize(
    "stage, tol",
    [(3, 0.10), pytest.param(0, 0.20, marks=pytest.mark.extended)],
    ids=["zero3", "plain"],
)
def test_rank_zero_holds_the_planned_copy_of_an_async_checkpoint(tmp_path, stage, tol):
    import h5py

    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.strategies.checkpoint_memory import checkpoint_host_bytes, model_state_bytes

    sets = [*MODEL, f"train.zero={stage}", *SAVING, "checkpoint.at_epoch_end=false"]
    # in processes of its own: as a warm rank's eighth run (after the plan tests above)
    # its peak was once 2.1% above the plan (1,655 MiB against 1,620, 7 Dec), where fresh
    # processes peak 5% under it (1,474-1,486 against 1,563)
    events = _events(tmp_path / "run", sets, None, fresh=True)
    steps = [x for x in events if x["event"] == "step"]
    peak = max(x["mem_peak_rss_bytes"] for x in steps)
    cfg = Config.load(None, sets)
    inp = benchmark_input_spec(cfg.data)
    saves = checkpoint_host_bytes(cfg, inp, 0, 2, False, gathers=stage > 0)
    assert saves == model_state_bytes(cfg, inp)  # one copy, both ways
    planned = steps[-1]["mem_rss_before_model_bytes"] + _plan(stage, 2, SAVING)["total"] + saves
    print(f"ZeRO-{stage} + async saves: peak RSS {peak / MIB:,.0f} MiB, plan {planned / MIB:,.0f}")
    assert planned >= peak * 0.98 and planned == pytest.approx(peak, rel=tol), (peak, planned)
    # the state the plan counts is what the file holds: weights and optimizer slots
    newest = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.h5"))[-1]
    held = []
    with h5py.File(newest) as f:
        for group in ("model", "optimizer"):
            f[group].visititems(lambda _, o: held.append(getattr(o, "nbytes", 0)))
    assert sum(held) == pytest.approx(saves, rel=0.01), (sum(held), saves)


# --- a pipeline's stages --------------------------------------------------------------------
# The same model cut in two stages at np 2 (one rank a stage, Adam, 4 micro-batches); the
# summary gives each stage's plan (the check's, before the stage was built) beside its
# measured peak RSS. Measured here (MiB, stage 0 and 1, 28 Nov): 1F1B plan 750 and 742,
# peak RSS 815-859 and 785-832 (5-15% over: the heap keeps freed blocks, as for ZeRO-3
# above), with freed blocks returned 774-776 and 765-766 (3%); GPipe plan 767 and 768,
# peak 832-842 and 812-829 (6-10%), with freed blocks returned 786-791 and 786-788 (2-3%).
# The live memory is held to 10%, the heap's peak to the check's warning margin, 15%.
PIPE = [*MODEL, "strategy=pipeline", "pipeline.stages=2", "pipeline.microbatches=4"]


@pytest.mark.parametrize(
    "schedule, env, tol",
    [("1f1b", RETURN_FREED, 0.10), ("gpipe", None, 0.15)],
    ids=["1f1b-freed-returned", "gpipe"],
)
def test_each_pipeline_stage_meets_its_plan(tmp_path, schedule, env, tol):
    events = _events(tmp_path / "run", [*PIPE, f"pipeline.schedule={schedule}"], env, fresh=True)
    summary = next(x for x in events if x["event"] == "summary")
    plan, peak = summary["stage_plan_memory_mib"], summary["stage_peak_memory_mib"]
    print(f"{schedule}: plan {plan} MiB, peak RSS {peak} MiB")
    assert summary["stage_peak_memory_of"] == "peak RSS"
    for planned, measured in zip(plan, peak, strict=True):
        assert measured >= planned * 0.98, (plan, peak)  # the plan is no overestimate
        assert planned == pytest.approx(measured, rel=tol), (plan, peak)
