"""Cost of the trainer's per-step metrics allreduce, run inside every rank.

Why: besides the gradients, hpctrain's loop allreduces one 4-number vector per step
(loss, correct, count, non-finite flag) through `World.allreduce_array`, which also
tells the collective watchdog about it. This times that call against a bare mpi4py
`Allreduce` of the same buffer, so the ablation can say what the extra call costs.

    mpirun -np 2 python benchmarks/workers/step_allreduce.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    from hpctrain import runtime

    world = runtime.world(60.0)
    comm, MPI = world.comm, world.MPI
    local = np.array([1.5, 3.0, 64.0, 0.0])

    def bare():
        buf = local.copy()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def trainer():
        world.allreduce_array(local, "sum", "step metrics")

    out = {"n": world.size}
    for name, fn in (("bare_mpi4py", bare), ("world_allreduce_array", trainer)):
        for _ in range(50):
            fn()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        out[name + "_us"] = (
            comm.allreduce((time.perf_counter() - t0) / args.iters, op=MPI.MAX) * 1e6
        )
    if world.rank == 0:
        with open(args.json, "w") as f:
            json.dump(out, f)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
