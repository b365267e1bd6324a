#!/usr/bin/env python
"""Checkpoint save/load speed: hpctrain's format against plain h5py and torch.save.

    .venv/bin/python benchmarks/bench_checkpoint.py                  # 300 MB, 3 repeats
    .venv/bin/python benchmarks/bench_checkpoint.py --mb 1000 --dir /scratch/me --json out.json

The state is float32 arrays of mixed sizes (a few large, many small, like a real model
with its optimizer slots). Every writer gets the same arrays in the same run. hpctrain's
save hashes every dataset, re-reads the file for the whole-file digest and fsyncs file
and directory; its load verifies all of that. "plain h5py" writes the same datasets
without any of it; "+ fsync" adds only the fsync, to show what durability alone costs.
Loads usually come from the page cache (the file was just written): they measure CPU
cost (HDF5, hashing), not the disk. "async save (caller)" is the time the training loop
is blocked: the in-memory copy only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.checkpoint import Checkpointer, CheckpointPolicy, load, save  # noqa: E402
from hpctrain.version import __version__  # noqa: E402


def make_state(mb: float, seed: int = 0) -> dict[str, np.ndarray]:
    """~mb MB of float32: 30% in large arrays, 40% medium, 30% in many small ones."""
    rng = np.random.default_rng(seed)
    total = int(mb * 1e6 / 4)
    state, i = {}, 0
    for share, size in ((0.3, 8_000_000), (0.4, 500_000), (0.3, 20_000)):
        budget = int(total * share)
        while budget > 0:
            n = min(budget, max(1, int(size * rng.uniform(0.5, 1.5))))
            state[f"model/layer{i}.weight"] = rng.random(n, dtype=np.float32)
            budget -= n
            i += 1
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_h5py_write(path: Path, state, fsync: bool) -> None:
    with h5py.File(path, "w") as f:
        for k, v in state.items():
            f.create_dataset(k, data=v)
    if fsync:
        _fsync(path)


def plain_h5py_read(path: Path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None
        )
    return out


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run(mb: float, repeats: int, directory: Path) -> dict:
    state = make_state(mb)
    nbytes = sum(v.nbytes for v in state.values())
    rows: dict[str, list[float]] = {}
    ours = directory / "ours"
    plain = directory / "plain.h5"
    rows["hpctrain save (sync)"] = timed(lambda: save(ours, 1, state, {"step": 1}), repeats)
    rows["hpctrain load (verify all)"] = timed(lambda: load(ours / "ckpt-00000001.h5"), repeats)
    rows["plain h5py write"] = timed(lambda: plain_h5py_write(plain, state, False), repeats)
    rows["plain h5py write + fsync"] = timed(lambda: plain_h5py_write(plain, state, True), repeats)
    rows["plain h5py read"] = timed(lambda: plain_h5py_read(plain), repeats)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}
        pt = directory / "state.pt"
        rows["torch.save"] = timed(lambda: torch.save(tensors, pt), repeats)
        rows["torch.load (weights_only)"] = timed(
            lambda: torch.load(pt, weights_only=True), repeats
        )
    ck = Checkpointer(CheckpointPolicy({"dir": str(directory / "async"), "async": True}))
    caller, total = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        ck.save(100 + r, state, {"step": 100 + r})
        caller.append(time.perf_counter() - t0)
        ck.wait()
        total.append(time.perf_counter() - t0)
    rows["async save (caller blocked)"] = caller
    rows["async save (until written)"] = total
    return {
        "mb": nbytes / 1e6,
        "arrays": len(state),
        "repeats": repeats,
        "dir": str(directory),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "versions": {
            "hpctrain": __version__,
            "h5py": h5py.version.version,
            "hdf5": h5py.version.hdf5_version,
            "numpy": np.__version__,
            "torch": getattr(torch, "__version__", None),
        },
        "file_mb": (ours / "ckpt-00000001.h5").stat().st_size / 1e6,
        "results": {
            name: {
                "median_s": statistics.median(t),
                "min_s": min(t),
                "mb_per_s": nbytes / 1e6 / statistics.median(t),
                "times_s": t,
            }
            for name, t in rows.items()
        },
    }


def print_table(report: dict) -> None:
    print(
        f"checkpoint benchmark: {report['mb']:.0f} MB in {report['arrays']} float32 arrays, "
        f"median of {report['repeats']}, dir {report['dir']}"
    )
    print(f"{'operation':<30} {'seconds':>9} {'MB/s':>9}")
    for name, r in report["results"].items():
        print(f"{name:<30} {r['median_s']:>9.3f} {r['mb_per_s']:>9.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300.0, help="state size in MB (default 300)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per operation (median shown)")
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="hpctrain-bench-", dir=args.dir))
    try:
        report = run(args.mb, max(1, args.repeat), base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
