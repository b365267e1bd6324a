"""Train with the public API, then check replicas and dump rank 0's weights for a test.

usage: train_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]
                     [--next OUT2.npz [--run-dir DIR] [--set key=value ...]] ...
Every rank compares a checksum of every parameter with allreduce MIN and MAX (so a
divergent replica fails the job), and rank 0 writes the final weights (pickle-free npz).
Each `--next` is one more run, trained after the one before it in the same processes:
one launch (MPI, torch or TensorFlow start-up, ~4 s) for several runs. Every run
builds its own Trainer, which reseeds every random stream of the process, so a run's
weights equal those it would have in a fresh process (measured bit for bit with both
backends: a Horovod run after an MPI-engine run; and a leak from one run into the next
would fail test_overlapped_step_metrics_change_nothing_but_timing, whose two runs share
a launch and must end identical).
"""

import argparse
import sys

import numpy as np
import step_reads
from run_list import split_runs

from hpctrain import Config, Trainer
from hpctrain.runtime import Faults, run_fail_together


def run_one(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--run-dir")
    parser.add_argument("--resume")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    trainer = Trainer(
        Config.load(None, args.overrides),
        run_dir=args.run_dir or args.out + ".run",
        resume=args.resume,
        faults=Faults.from_env(),  # the tests' HPCTRAIN_FAULT_* (e.g. kill_during_save)
    )
    trainer.fit()
    step_reads.check(args.out)
    weights = trainer.strategy.backend.get_weights()
    w = trainer.world
    sums = np.array(
        [np.float64(v.astype(np.float64).sum()) for v in weights.values()]
        + [np.float64((v.astype(np.float64) ** 2).sum()) for v in weights.values()]
    )
    lo = w.allreduce_array(sums, "min", "replica checksum min")
    hi = w.allreduce_array(sums, "max", "replica checksum max")
    if not np.array_equal(lo, hi):
        bad = [k for i, k in enumerate(weights) if lo[i] != hi[i]]
        raise SystemExit(f"{args.out}: replicas differ after training in: {bad}")
    if w.rank == 0:
        np.savez(args.out, **weights)
        # One write: a log line on stderr could land between a print's text and its "\n".
        sys.stdout.write(
            f"REPLICAS IDENTICAL over {w.size} rank(s): {len(weights)} tensors: {args.out}\n"
        )
        sys.stdout.flush()


def main():
    step_reads.watch()
    for argv in split_runs(sys.argv[1:]):
        run_one(argv)


sys.exit(run_fail_together(main))
