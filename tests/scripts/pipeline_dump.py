"""Run several trainings in one MPI job and dump rank 0's canonical weights per run.

usage: pipeline_dump.py OUT_DIR "NAME:key=value;key=value" ["NAME:..."]
Each argument is one run: `strategy=pipeline` runs use PipelineTrainer, others the
data-parallel Trainer. Runs execute in order in the same processes (Horovod can be
initialised once per process, so a run with replicas must come last). For pipeline
runs every rank also reloads the gathered weights (canonical names, as a data-parallel
checkpoint holds them) and checks the round trip. Rank 0 writes OUT_DIR/NAME.npz and
prints `SUMMARY NAME {json}`.
"""

import json
import sys
from pathlib import Path

import numpy as np
import step_reads

from hpctrain import Config, TrainingLoop
from hpctrain.runtime import Faults, run_fail_together


def run_one(out_dir: Path, spec: str):
    name, _, overrides = spec.partition(":")
    cfg = Config.load(None, [o for o in overrides.split(";") if o])
    run_dir = out_dir / f"{name}.run"
    trainer = TrainingLoop(cfg, run_dir=run_dir, faults=Faults.from_env())  # a test's faults
    summary = trainer.fit()
    step_reads.check(name)  # a step over a process group's links read on the host
    w = trainer.world
    if cfg.strategy == "pipeline":
        weights = trainer.strategy.get_weights()
        full = w.bcast_object(weights, what="round trip")
        trainer.strategy.set_weights(full)
        again = trainer.strategy.get_weights()
        if w.rank == 0:
            for k in weights:
                if not np.array_equal(weights[k], again[k]):
                    raise SystemExit(f"{name}: set_weights/get_weights round trip changed {k}")
    else:
        weights = trainer.strategy.backend.get_weights()
    if w.rank == 0:
        np.savez(out_dir / f"{name}.npz", **weights)
        print(f"SUMMARY {name} {json.dumps(summary)}", flush=True)


def main():
    step_reads.watch()
    out_dir = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        run_one(out_dir, spec)


sys.exit(run_fail_together(main))
