"""Flat MPI_Allreduce vs hpctrain's hierarchical allreduce, inside every rank.

    mpirun (2 nodes x 2 ranks) python benchmarks/workers/hier_allreduce.py --json out.json

Both average the same float32 buffer on the World (its guarded collectives, as training
uses them); median of `--iters` timed calls after a warm-up, per size.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hpctrain.exchange.hierarchical import HierarchicalMean
from hpctrain.exchange.reducer import DenseMean
from hpctrain.runtime import world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,4,16")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    w = world()
    rows = []
    for mb in (float(x) for x in args.sizes_mb.split(",")):
        n = int(mb * 2**20) // 4
        out = {"bytes": n * 4}
        for name, cls in (("flat", DenseMean), ("hierarchical", HierarchicalMean)):
            reducer = cls(w, [n])
            times = []
            for _ in range(args.iters + 2):
                reducer.buffer[:] = np.float32(w.rank + 1)
                w.barrier("bench: line up")
                t = time.perf_counter()
                reducer.reduce(0)
                times.append(time.perf_counter() - t)
            expected = np.float32((w.size + 1) / 2)
            assert np.allclose(reducer.buffer, expected), name
            out[name] = float(np.median(times[2:]))
        rows.append(out)
    if w.is_root:
        with open(args.json, "w") as f:
            json.dump({"ranks": w.size, "nodes": w.layout.nodes, "rows": rows}, f)


if __name__ == "__main__":
    main()
