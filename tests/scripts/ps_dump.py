"""Train with the parameter server and dump worker 0's final weights (pickle-free npz).

usage: ps_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]   (strategy is set to parameter_server)
TIMEOUT (env): the collective timeout once the run is built (the final wait's under test).
Every worker checks that it holds the same final weights (allreduce MIN = MAX of
checksums over all ranks; servers contribute the workers' values through worker 0).
"""

import os
import sys

import numpy as np

from hpctrain import Config, TrainingLoop
from hpctrain.runtime import Faults, run_fail_together, world


def main():
    out, rest = sys.argv[1], sys.argv[2:]
    opts = {}
    for flag in ("--resume", "--run-dir"):
        if flag in rest:
            i = rest.index(flag)
            opts[flag] = rest[i + 1]
            del rest[i : i + 2]
    overrides = [a for a in rest if a != "--set"]
    loop = TrainingLoop(
        Config.load(None, [*overrides, "strategy=parameter_server"]),
        run_dir=opts.get("--run-dir", out + ".run"),
        resume=opts.get("--resume"),
        faults=Faults.from_env(),  # the tests' HPCTRAIN_FAULT_* (a slow or silent worker)
    )
    if os.environ.get("TIMEOUT"):  # from here on: the start keeps the configured one
        world(collective_timeout=float(os.environ["TIMEOUT"]))
    loop.fit()
    w, runner = loop.world, loop.strategy
    weights = getattr(runner, "final_weights", None)
    n = len(runner.shapes) * 2
    sums = (
        np.zeros(n)
        if weights is None
        else np.array(
            [
                np.float64(v.astype(np.float64).sum())
                for k, v in weights.items()
                if k in runner.shapes
            ]
            + [
                np.float64((v.astype(np.float64) ** 2).sum())
                for k, v in weights.items()
                if k in runner.shapes
            ]
        )
    )
    big = np.full(n, np.inf)
    lo = w.allreduce_array(big if weights is None else sums, "min", "checksum min")
    hi = w.allreduce_array(-big if weights is None else sums, "max", "checksum max")
    if not np.array_equal(lo, hi):
        raise SystemExit("workers hold different final weights")
    if w.rank == 0:
        np.savez(out, **weights)
        print(f"WORKERS IDENTICAL over {runner.n_workers} worker(s): {len(weights)} tensors")


sys.exit(run_fail_together(main))
