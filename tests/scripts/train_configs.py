"""Train configuration files one after another in the same mpirun launch.

usage: train_configs.py CONFIG RUN_DIR [--set key=value ...] [--next CONFIG RUN_DIR ...]
Each run is what `hpctrain train --config CONFIG --run-dir RUN_DIR --set ...` does (the
same Config.load and TrainingLoop), after the one before it in the same processes: one
launch (MPI and framework start-up, most of a small run's time) for several configs.
Every loop reseeds the process and builds its own grid and strategy. Rank 0 prints
`CONFIG TRAINED <config> <summary as JSON>` after each run, in one write.
"""

import json
import sys

from run_list import split_runs

from hpctrain import Config, TrainingLoop
from hpctrain.runtime import Faults, run_fail_together


def run_one(argv: list[str]) -> None:
    config, run_dir, rest = argv[0], argv[1], argv[2:]
    overrides = [a for a in rest if a != "--set"]
    cfg = Config.load(config, overrides)
    loop = TrainingLoop(cfg, run_dir=run_dir, faults=Faults.from_env())  # a test's faults
    summary = loop.fit()
    if loop.world.rank == 0:
        sys.stdout.write(f"CONFIG TRAINED {config} {json.dumps(summary, default=str)}\n")
        sys.stdout.flush()


def main():
    for argv in split_runs(sys.argv[1:]):
        run_one(argv)


sys.exit(run_fail_together(main))
