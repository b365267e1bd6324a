"""Allreduce microbenchmark, run inside every rank: mpi4py, Horovod torch or Horovod TF.

Why: the training numbers depend on what one allreduce costs at each size through each
path hpctrain can use. nccl-tests conventions: time per operation, algbw = bytes / t,
busbw = algbw · 2(n-1)/n, and #wrong = elements that differ from the exact expected sum
(rank r contributes (r + 1) · (i mod 13 + 1), exactly representable in float32).
Horovod also runs "64 tensors of S/64 at once": what Tensor Fusion is for.

    mpirun -np 2 python benchmarks/workers/allreduce.py --lib torch --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
PIECES = 64


def pattern(count: int) -> np.ndarray:
    return ((np.arange(count) % 13) + 1).astype(np.float32)


def make_input(count: int) -> np.ndarray:
    return pattern(count) * np.float32(comm.rank + 1)


def count_wrong(result: np.ndarray) -> int:
    n = comm.size
    expected = pattern(result.size) * np.float32(n * (n + 1) // 2)
    return int(np.count_nonzero(result.reshape(-1) != expected))


class MpiLib:
    name = "MPI_Allreduce (mpi4py)"

    def prepare(self, count, pieces, tag):
        self.send = make_input(count)
        self.recv = np.empty_like(self.send)

    def run(self):
        comm.Allreduce(self.send, self.recv, op=MPI.SUM)

    def result(self):
        return self.recv


class TorchLib:
    name = "Horovod torch"

    def __init__(self):
        import horovod.torch as hvd
        import torch

        hvd.init(comm=comm)
        torch.set_num_threads(1)
        self.hvd, self.torch = hvd, torch

    def prepare(self, count, pieces, tag):
        full = self.torch.from_numpy(make_input(count))
        self.inputs = list(full.chunk(pieces)) if pieces > 1 else [full]
        self.names = [f"{tag}.{j}" for j in range(len(self.inputs))]

    def run(self):
        # One async allreduce per tensor, then wait for all: DistributedOptimizer's pattern.
        handles = [
            self.hvd.allreduce_async(t, name=nm, op=self.hvd.Sum)
            for t, nm in zip(self.inputs, self.names)
        ]
        self.outputs = [self.hvd.synchronize(h) for h in handles]

    def result(self):
        return np.concatenate([o.numpy().reshape(-1) for o in self.outputs])


class TensorFlowLib:
    name = "Horovod TF"

    def __init__(self):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        hvd.init(comm=comm)
        self.hvd, self.tf = hvd, tf

    def prepare(self, count, pieces, tag):
        full = make_input(count)
        parts = np.array_split(full, pieces) if pieces > 1 else [full]
        self.inputs = [self.tf.constant(p) for p in parts]
        self.tag = tag

    def run(self):
        # Several tensors go as one grouped_allreduce: how hpctrain's TF backend sends them.
        if len(self.inputs) == 1:
            self.outputs = [self.hvd.allreduce(self.inputs[0], op=self.hvd.Sum, name=self.tag)]
        else:
            self.outputs = self.hvd.grouped_allreduce(self.inputs, op=self.hvd.Sum, name=self.tag)

    def result(self):
        return np.concatenate([o.numpy().reshape(-1) for o in self.outputs])


def iterations(nbytes: int, quick: bool) -> int:
    budget = (32 if quick else 256) * 2**20  # bytes moved per size, roughly
    return int(max(3, min(20 if quick else 100, budget // max(nbytes, 1))))


def measure(lib, nbytes: int, pieces: int, quick: bool) -> dict:
    count = max(1, nbytes // 4)
    lib.prepare(count, pieces, f"b{nbytes}x{pieces}")
    iters = iterations(nbytes, quick)
    for _ in range(2 if nbytes < 2**24 else 1):  # warm-up (Horovod: fill its caches)
        lib.run()
    comm.Barrier()
    local = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        lib.run()
        local[i] = time.perf_counter() - t0
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    # The median resists a neighbour's burst of CPU load on a shared machine.
    seconds = float(np.median(slowest))
    wrong = comm.allreduce(count_wrong(lib.result()), op=MPI.SUM)
    n = comm.size
    real_bytes = count * 4
    algbw = real_bytes / seconds
    return {
        "bytes": real_bytes,
        "tensors": pieces,
        "iters": iters,
        "seconds": seconds,
        "mean_seconds": float(slowest.mean()),
        "algbw": algbw,
        "busbw": algbw * 2 * (n - 1) / n,
        "wrong": wrong,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", choices=("mpi", "torch", "tensorflow"), required=True)
    p.add_argument("--max-bytes", type=int, default=256 * 2**20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--multi", action="store_true", help=f"also {PIECES} tensors of S/{PIECES}")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    lib = {"mpi": MpiLib, "torch": TorchLib, "tensorflow": TensorFlowLib}[args.lib]()
    sizes = [8 * 4**k for k in range(20) if 8 * 4**k <= args.max_bytes]
    if args.max_bytes not in sizes:
        sizes.append(args.max_bytes)
    rows = []
    for nbytes in sizes:
        modes = [1] + ([PIECES] if args.multi and nbytes >= 4 * PIECES else [])
        for pieces in modes:
            row = measure(lib, nbytes, pieces, args.quick)
            rows.append(row)
            if comm.rank == 0:
                print(
                    f"{row['bytes']:>11d} B x{pieces:<3d} {row['seconds'] * 1e6:11.1f} us "
                    f"algbw {row['algbw'] / 1e9:7.3f} GB/s busbw {row['busbw'] / 1e9:7.3f} GB/s "
                    f"#wrong {row['wrong']}",
                    flush=True,
                )
    if comm.rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "OMPI_MCA_"))}
        with open(args.json, "w") as f:
            json.dump({"lib": lib.name, "n": comm.size, "env": env, "rows": rows}, f)


if __name__ == "__main__":
    main()
