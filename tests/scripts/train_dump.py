"""Train with the public API, then check replicas and dump rank 0's weights for a test.

usage: train_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]
Every rank compares a checksum of every parameter with allreduce MIN and MAX (so a
divergent replica fails the job), and rank 0 writes the final weights (pickle-free npz).
"""

import argparse
import sys

import numpy as np

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--run-dir")
    parser.add_argument("--resume")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    trainer = Trainer(
        Config.load(None, args.overrides),
        run_dir=args.run_dir or args.out + ".run",
        resume=args.resume,
    )
    trainer.fit()
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
        raise SystemExit(f"replicas differ after training in: {bad}")
    if w.rank == 0:
        np.savez(args.out, **weights)
        print(f"REPLICAS IDENTICAL over {w.size} rank(s): {len(weights)} tensors")


sys.exit(run_fail_together(main))
