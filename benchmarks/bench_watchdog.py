"""Per-collective cost of the collective watchdog at np 2, 4, 8, 16, projected to 4,096.

Why: every guarded collective (several per training step) pays the watchdog's
happy-path cost, so it must not grow with the number of ranks. Measured on the same
ranks, per collective:

- guard: entering and leaving `Watchdog.guard` alone, in thread CPU time (the
  slowest rank's mean);
- barrier raw / guarded: `MPI_Barrier` bare and under the guard (medians of blocks);
- old notices: the previous protocol's extra work, one arrival message from every
  rank to rank 0 and N-1 receives there, timed on rank 0 around a bare barrier.

    python benchmarks/bench_watchdog.py [--nps 2,4,8,16] [--out FILE]   (runs mpirun)

Oversubscribed ranks (16 on a 2-core machine) make the barrier columns slow and noisy;
the guard column and the message counts are what the projection rests on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# yield when idle, as training runs (loop.prepare_process): oversubscribed ranks share cores
ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def _block_median(fn, iters: int, blocks: int, comm, clock=time.perf_counter) -> float:
    """Median over blocks of the slowest rank's mean seconds per call."""
    from mpi4py import MPI

    per_call = []
    for _ in range(blocks):
        comm.Barrier()
        t0 = clock()
        for _ in range(iters):
            fn()
        dt = (clock() - t0) / iters
        per_call.append(comm.allreduce(dt, op=MPI.MAX))
    return float(np.median(per_call))


def worker(iters: int, blocks: int) -> None:
    from hpctrain.runtime import world

    w = world(collective_timeout=600)
    comm, wd = w.comm, w.watchdog

    def guard_only():
        with wd.guard("bench guard"):
            pass

    def raw_barrier():
        comm.Barrier()

    def guarded_barrier():
        with wd.guard("bench barrier"):
            comm.Barrier()

    buf = np.zeros(1, dtype=np.int64)

    def old_notices():  # the previous protocol: one notice per rank, N-1 receives on 0
        if w.rank == 0:
            for src in range(1, w.size):
                comm.Recv(buf, source=src, tag=7)
        else:
            comm.Send(buf, dest=0, tag=7)
        comm.Barrier()

    row = {"np": w.size}
    # the guard alone costs CPU only: thread CPU time, immune to oversubscription
    row["guard_us"] = _block_median(guard_only, iters * 20, blocks, comm, time.thread_time) * 1e6
    for name, fn in (
        ("raw_us", raw_barrier),
        ("guarded_us", guarded_barrier),
        ("old_us", old_notices),
    ):
        row[name] = _block_median(fn, iters, blocks, comm) * 1e6
    row["old_extra_us"] = row["old_us"] - row["raw_us"]
    if w.rank == 0:
        print("ROW " + json.dumps(row), flush=True)


def _run(np_: int, iters: int, blocks: int) -> dict:
    args = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable, __file__]
    args += ["--worker", "--iters", str(iters), "--blocks", str(blocks)]
    out = subprocess.run(
        args, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    raise RuntimeError(f"np {np_} failed:\n{out.stdout}\n{out.stderr}")


def table(rows: list[dict]) -> str:
    lines = [
        "| np | guard (us) | barrier raw (us) | barrier guarded (us) | watchdog messages "
        "per collective | old notices: extra on rank 0 (us) | old: receives on rank 0 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['np']} | {r['guard_us']:.2f} | {r['raw_us']:.1f} | {r['guarded_us']:.1f} "
            f"| 0 | {r['old_extra_us']:.1f} | {r['np'] - 1} |"
        )
    guard = max(r["guard_us"] for r in rows)
    # old protocol: rank 0's extra time per collective grows with N-1 receives
    n = np.array([r["np"] - 1 for r in rows], dtype=float)
    slope = float(np.polyfit(n, [r["old_extra_us"] for r in rows], 1)[0]) if len(rows) > 1 else 0
    for big in (1024, 4096):
        lines.append(
            f"| {big} (projected) | {guard:.2f} | - | - | 0 | "
            f"{max(slope, 0) * (big - 1):.0f} | {big - 1} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nps", default="2,4,8,16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.worker:
        worker(a.iters, a.blocks)
        return
    rows = [_run(int(p), a.iters, a.blocks) for p in a.nps.split(",")]
    text = table(rows)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
