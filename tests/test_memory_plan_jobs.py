"""The memory plan (`hpctrain plan-memory`, exchange/memory_plan.py) against the peak
resident memory real runs reach, under real mpirun: for ZeRO 0, 1, 2 and 3, a ~50 M
parameter transformer (Adam, float32) at np 2, each stage in its own launch (a peak
RSS is a process's high-water mark), the plan within 10% of the measured peak.

Measured here (MiB, rank 0, peak RSS vs plan, three runs on 28 Nov, torch's fused
Adam): plain 1,429-1,446 vs 1,398-1,400; ZeRO-1 1,568-1,586 vs 1,495-1,497; ZeRO-2
1,013-1,018 vs 981-982; ZeRO-3 1,023-1,031 vs 983 (4-5%).

ZeRO-3's excess is glibc's heap keeping freed blocks: hpctrain sets glibc to keep freed
memory below 32 MiB for speed (runtime/allocator.py), and ZeRO-3 frees and reallocates
blocks of many sizes (parameter gradients, reduce-scatter pieces), so the heap's
high-water mark stays above the live memory the plan counts. With
MALLOC_MMAP_THRESHOLD_=4194304 (blocks over 4 MiB go back to the kernel when freed) the
peak is 988-989 MiB, within 1% of the plan. (Before Adam was fused, its step's
temporaries made ZeRO-3's excess 7-12%, and the test allowed it 15%.)
"""

from __future__ import annotations

import json

import pytest
from mpirun import HPCTRAIN, mpirun
from test_memory_limit_jobs import MODEL as LIMIT_MODEL

MIB = 1 << 20
MODEL = LIMIT_MODEL  # the 50 M transformer (Adam), 3 steps, MPI engine, no checkpoints


def _plan(stage: int, np_: int) -> dict:
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_plan import plan_shape
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.exchange.memory_plan import plan_stage

    cfg = Config.load(None, [*MODEL, f"train.zero={stage}"])
    t = cfg.train
    shape = plan_shape(cfg.model, benchmark_input_spec(cfg.data), ModelGroups(), t["batch_size"])
    unit, bucket = int(t["zero_unit_mb"] * MIB), int(t["bucket_mb"] * MIB)
    return plan_stage(shape, np_, stage, cfg.optimizer, unit, bucket)


RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}  # allocator.py honours it


@pytest.mark.parametrize(
    "stage, env, tol",
    [(0, None, 0.10), (1, None, 0.10), (2, None, 0.10), (3, None, 0.10), (3, RETURN_FREED, 0.10)],
    ids=["0", "1", "2", "3", "3-freed-returned"],
)
def test_the_plan_matches_the_measured_peak(tmp_path, stage, env, tol):
    run = tmp_path / "run"
    args = [HPCTRAIN, "train", "--run-dir", str(run)]
    for o in [*MODEL, f"train.zero={stage}"]:
        args += ["--set", o]
    # its own processes: their RSS is measured
    job = mpirun(2, *args, timeout=300, fresh=True, env=env)
    assert job.returncode == 0, job.output
    steps = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    steps = [x for x in steps if x["event"] == "step"]
    peak = max(x["mem_peak_rss_bytes"] for x in steps)
    planned = steps[-1]["mem_rss_before_model_bytes"] + _plan(stage, 2)["total"]
    print(f"ZeRO-{stage}: peak RSS {peak / MIB:,.0f} MiB, plan {planned / MIB:,.0f} MiB")
    assert planned == pytest.approx(peak, rel=tol), (peak / MIB, planned / MIB)
