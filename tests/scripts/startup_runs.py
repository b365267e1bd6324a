"""Train several short runs one after the other in the same processes (one launch).

usage: startup_runs.py RUN_DIR [--set key=value ...] [--next RUN_DIR2 [--set ...]] ...
Each run builds its own loop (which logs its startup line and warnings) and trains;
rank 0 then prints `RUN DONE <run dir>` so a test can cut the output into runs.
"""

import sys

from run_list import split_runs

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together


def run_one(argv: list[str]) -> None:
    run_dir, overrides = argv[0], [a for a in argv[1:] if a != "--set"]
    trainer = Trainer(Config.load(None, overrides), run_dir=run_dir)
    trainer.fit()
    if trainer.world.rank == 0:
        sys.stderr.write(f"RUN DONE {run_dir}\n")  # after this run's log lines (stderr)
        sys.stderr.flush()


def main():
    for argv in split_runs(sys.argv[1:]):
        run_one(argv)


sys.exit(run_fail_together(main))
