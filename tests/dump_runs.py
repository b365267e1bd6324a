"""What the job tests share: the tiny transformer they train, and the one way to train
several small runs in one mpirun launch through a tests/scripts/*_dump.py script (each
run reseeds the process, so sharing a launch changes no number; the launch, not the
steps, is most of a small run's time)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpirun import PYTHON, mpirun

# The transformer every job test trains: 4 heads of 8 over a 32-token vocabulary.
TINY_TRANSFORMER = [
    "model.name=transformer",
    "data.task=tokens",
    "model.d_model=32",
    "model.n_heads=4",
    "model.d_ff=64",
    "data.seq_len=16",
    "data.vocab=32",
]


def train_many(
    script: str | Path,
    where: Path,
    np_: int,
    runs: dict[str, list[str]],
    *,
    base: list[str],
    said: Callable[[Path], str],
    keep: Callable[[dict], object],
    timeout: float = 300,
    run_dir: Path | None = None,
    resume: str | None = None,
) -> dict:
    """{name: (weights, [keep(line) of each step line], match)} of `runs` trained one
    after the other in one launch of `script` (`--next` between runs; `base` overrides
    first). `said(npz)` is the regex the script prints after a run (its match is
    returned); run_dir/resume: for a single run."""
    args, dirs = [str(script)], {}
    for name, overrides in runs.items():
        args += ["--next"] if len(args) > 1 else []
        dirs[name] = run_dir or where / f"{name}.npz.run"
        args += [str(where / f"{name}.npz"), "--run-dir", str(dirs[name])]
        if resume:
            args += ["--resume", resume]
        for o in [*base, *overrides]:
            args += ["--set", o]
    job = mpirun(np_, PYTHON, *args, timeout=timeout)
    assert job.returncode == 0, job.output
    results = {}
    for name in runs:
        out = where / f"{name}.npz"
        match = re.search(said(out), job.output)
        assert match, job.output
        with np.load(out) as f:
            weights = {k: f[k] for k in f.files}
        lines = [json.loads(x) for x in (dirs[name] / "metrics.jsonl").open()]
        results[name] = weights, [keep(x) for x in lines if x["event"] == "step"], match
    return results
