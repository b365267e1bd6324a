"""The GPU bench's own code (benchmarks/gpu_bench.py) runs here, on the CPU at a tiny
size (`--dry-run`): hpctrain's step, an async checkpoint's stall with its report line,
and the data path through the device feeder. No figures; a slip in the bench is found
here instead of in a 15-minute GPU loan (tools/gpu_check.sh's bench step)."""

import json
import math
import subprocess
import sys

from mpirun import ROOT


def test_the_gpu_benchs_device_sections_dry_run_on_the_cpu(tmp_path):
    bench = ROOT / "benchmarks" / "gpu_bench.py"
    job = subprocess.run(
        [sys.executable, str(bench), "--out", str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    got = json.loads(job.stdout)
    assert math.isfinite(got["loss_sum"]) and got["loss_sum"] > 0
    ckpt = got["checkpoint"]
    assert "error" not in ckpt and ckpt["state_gib"] > 0, ckpt
    for mode in ("copied", "staged"):
        assert math.isfinite(ckpt[f"{mode}_stall_ms"]) and ckpt[f"{mode}_call_ms"] > 0
    assert got["checkpoint_line"].startswith("Async checkpoint of a GPU rank (transformer-dry")
    assert got["data_path"]["ratio"] > 0
    assert not (tmp_path / "dry-ckpt").exists()  # the bench removes its checkpoints
