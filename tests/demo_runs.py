"""The demo (configs/demo.yaml, `mpirun -np 2`), each distinct setting trained once per
test session: runs are seeded and deterministic, so the tests that compare against the
same float32 baseline (compression, bf16, the demo's own accuracy) share its run."""

from __future__ import annotations

import re
from pathlib import Path

from mpirun import HPCTRAIN, ROOT, mpirun

DEMO = str(ROOT / "configs" / "demo.yaml")
# Half the demo's 12 epochs, for the tests that compare a setting with float32 (bf16,
# compressors): their comparisons hold there with a margin and cost half as much; the
# demo's own accuracy at 12 epochs is test_trainer_jobs.py's.
SHORT = "train.epochs=6"
_RUNS: dict[tuple[str, ...], tuple[Path, str]] = {}


def demo_run(tmp_path_factory, *overrides: str) -> tuple[Path, str]:
    """(run dir, output) of the demo with `--set` overrides (backend=torch is the default)."""
    key = tuple(sorted(o for o in overrides if o != "backend=torch"))
    if key not in _RUNS:
        run = tmp_path_factory.mktemp("demo") / "run"
        args = ["train", "--config", DEMO, "--run-dir", str(run), "--new"]
        for o in key:
            args += ["--set", o]
        job = mpirun(2, HPCTRAIN, *args, timeout=600)
        assert job.returncode == 0, job.output
        _RUNS[key] = (run, job.output)
    return _RUNS[key]


def demo_accuracy(tmp_path_factory, *overrides: str) -> float:
    """The final validation accuracy the demo run with `overrides` printed."""
    _, output = demo_run(tmp_path_factory, *overrides)
    return float(re.search(r"val_accuracy=([0-9.]+)", output).group(1))
