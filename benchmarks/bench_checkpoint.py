#!/usr/bin/env python
"""Checkpoint save/load speed: hpctrain's format against plain h5py and torch.save.

    .venv/bin/python benchmarks/bench_checkpoint.py                  # 300 MB, 3 repeats
    .venv/bin/python benchmarks/bench_checkpoint.py --quick          # 20 MB, 1 repeat
    .venv/bin/python benchmarks/bench_checkpoint.py --mb 1000 --dir /scratch/me --json out.json
    .venv/bin/python benchmarks/bench_checkpoint.py --ranks 4   # sharded rows with 4 ranks

The state is float32 arrays of mixed sizes (a few large, many small, like a real model
with its optimizer slots). Every writer gets the same arrays in the same run. hpctrain's
save hashes every dataset (from memory, while HDF5 writes: the whole-file digest reads
back only the HDF5 metadata) and fsyncs file and directory; its load verifies all of that. "plain h5py" writes the same datasets
without any of it; "+ fsync" adds only the fsync, to show what durability alone costs.
"sharded save, N ranks" is what a data-parallel run does by default: every rank holds
the state, writes 1/N of it to its own file, rank 0 gathers the records and commits
(under `mpirun -np N`, barrier to barrier); "plain h5py write, N ranks" writes the same
halves with nothing else, the limit of writing in parallel on this disk.
Loads usually come from the page cache (the file was just written): they measure CPU
cost (HDF5, hashing), not the disk. "async save (caller blocked)" is the time the
caller is blocked: the copy into buffers kept from the previous save (the first save
allocates them). The stall rows save the timed training step's own model as the loop
does with the torch backend: views of its live tensors, copied in the background while
the next step computes, whose update waits for the copy (hold_exported_state). The
stall is (save() + that next step) - a plain step, measured interleaved with plain
steps, over the plain step's time; the next 2 steps show what the write still running
in the background costs them on a machine without a spare core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
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


def sharded_rows(mb: float, repeats: int, directory: Path) -> dict[str, list[float]]:
    """Under mpirun: the sharded save and load, and plain parallel h5py writes, timed
    barrier to barrier on every rank (the slowest rank's time counts)."""
    from mpi4py import MPI

    from hpctrain.checkpoint import sharded

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    state = make_state(mb)
    ours = directory / "sharded"
    policy = CheckpointPolicy({"dir": str(ours), "keep_last": 2})
    ck = Checkpointer(policy, is_writer=rank == 0)
    mine = {k: p[2] for k, p in sharded.split_replicated(state, rank, size).items()}

    def save_sharded(step):
        pieces = sharded.split_replicated(state, rank, size)
        record = sharded.write_shard(ours, step, rank, size, pieces)
        records = comm.gather(record)
        if rank == 0:
            ck.save(step, {}, {"step": step}, shards=sharded.shard_table(records))

    def clocked(fn):
        out = []
        for r in range(repeats):
            os.sync()  # as in timed(): no earlier row's writeback inside this one
            comm.Barrier()
            t0 = time.perf_counter()
            fn(r)
            comm.Barrier()
            out.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return out

    rows = {}
    rows[f"sharded save, {size} ranks (sync)"] = clocked(lambda r: save_sharded(1 + r))
    last = ours / f"ckpt-{repeats:08d}.h5"
    rows[f"sharded load, {size} ranks each (verify all)"] = clocked(lambda r: load(last))
    plain = directory / f"plain-rank{rank}.h5"
    rows[f"plain h5py write, {size} ranks (1/{size} each)"] = clocked(
        lambda r: plain_h5py_write(plain, mine, False)
    )
    rows[f"plain h5py write + fsync, {size} ranks"] = clocked(
        lambda r: plain_h5py_write(plain, mine, True)
    )
    return rows


def run_sharded(mb: float, repeats: int, directory: Path, ranks: int) -> dict[str, list[float]]:
    """Start this script under `mpirun -np ranks` for the sharded rows; {} if it fails."""
    out = directory / "sharded.json"
    args = ["mpirun", "-np", str(ranks), "--bind-to", "none"]
    if ranks > (os.cpu_count() or 1):
        args.append("--oversubscribe")
    args += [sys.executable, __file__, "--mb", str(mb), "--repeat", str(repeats)]
    args += ["--sharded-worker", str(directory), "--json", str(out)]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        print(f"sharded rows failed (rc {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return {}
    return json.loads(out.read_text())


def training_step(torch, nbytes: int):
    """One SGD step (forward, backward, update) of an MLP of 4096 x 4096 layers holding
    about the checkpoint's bytes, batch 64: what the async save's stall is compared to.
    Before its update the step awaits the fences put in `fences`, as the torch backend
    awaits an async save's copy of its tensors (hold_exported_state)."""
    width = 4096
    layers = max(1, round(nbytes / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)
    fences = []

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        while fences:
            fences.pop()()
        opt.step()

    step()  # warm-up: first-touch of the gradient buffers
    mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    label = f"training step, {layers} x 4096^2 mlp ({mb:.0f} MB), batch 64"
    return label, model, step, fences


def async_saves(directory: Path, state, repeats: int):
    """Times of Checkpointer.save (async) on the caller's thread, and until written."""
    ck = Checkpointer(CheckpointPolicy({"dir": str(directory), "async": True}))
    caller, total = [], []
    for r in range(repeats):
        os.sync()
        t0 = time.perf_counter()
        ck.save(100 + r, state(), {"step": 100 + r})
        caller.append(time.perf_counter() - t0)
        ck.wait()
        total.append(time.perf_counter() - t0)
    return caller, total


def loop_saves(directory: Path, model, step, fences, repeats: int) -> dict[str, list[float]]:
    """The loop's async save of the step's model, interleaved with plain steps: views of
    the live tensors handed over, copied in the background during the next step, whose
    update waits for the copy; the write goes on during the steps after it."""
    ck = Checkpointer(CheckpointPolicy({"dir": str(directory), "async": True}))
    live = lambda: {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}  # noqa: E731
    rows = {k: [] for k in ("plain", "save", "next", "after", "written")}
    for r in range(repeats):
        os.sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        ck.save(100 + r, live(), {"step": 100 + r}, private=True, defer_copy=True)
        fences.append(ck.fence)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        step()
        step()
        t4 = time.perf_counter()
        ck.wait()
        t5 = time.perf_counter()
        for k, v in zip(rows, (t1 - t0, t2 - t1, t3 - t1, t4 - t3, t5 - t1)):
            rows[k].append(v)
    return rows


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        os.sync()  # earlier rows' dirty pages are written back before, not during, this one
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run(mb: float, repeats: int, directory: Path, ranks: int = 2) -> dict:
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
    caller, total = async_saves(directory / "async", lambda: state, repeats)
    rows["async save (caller blocked)"] = caller
    rows["async save (until written)"] = total
    step_row = None
    if torch is not None:
        step_row, model, step, fences = training_step(torch, nbytes)
        loop = loop_saves(directory / "async-model", model, step, fences, repeats)
        rows[step_row] = loop["plain"]
        rows["async save of the step's model: save() call"] = loop["save"]
        rows["async save of the step's model: save() + next step"] = loop["next"]
        rows["the 2 steps after that (the write goes on)"] = loop["after"]
        rows["async save of the step's model: save() until written"] = loop["written"]
    file_mb = (ours / "ckpt-00000001.h5").stat().st_size / 1e6
    if ranks > 1:
        # the rows above leave GBs of files in the page cache, which measurably slowed
        # the rows after them (sharded save 0.42 s after them, 0.30 s before them): gone
        for done in (
            ours,
            plain,
            directory / "state.pt",
            directory / "async",
            directory / "async-model",
        ):
            shutil.rmtree(done, ignore_errors=True) if done.is_dir() else done.unlink(True)
        rows.update(run_sharded(mb, repeats, directory / "mpi", ranks))
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "save / plain h5py write (1 process)": med["plain h5py write"]
        / med["hpctrain save (sync)"],
        "verified load / plain h5py read": med["plain h5py read"]
        / med["hpctrain load (verify all)"],
    }
    sharded_save = f"sharded save, {ranks} ranks (sync)"
    if sharded_save in med:
        ratios[f"sharded save ({ranks} ranks) / plain h5py write (1 process)"] = (
            med["plain h5py write"] / med[sharded_save]
        )
        ratios[f"sharded save / plain h5py write ({ranks} ranks)"] = (
            med[f"plain h5py write, {ranks} ranks (1/{ranks} each)"] / med[sharded_save]
        )
        ratios["sharded load / plain h5py read"] = (
            med["plain h5py read"] / med[f"sharded load, {ranks} ranks each (verify all)"]
        )
    blocked = stall = write_cost = None
    if step_row is not None:
        plain = med[step_row]
        blocked = med["async save of the step's model: save() call"] / plain
        stall = (med["async save of the step's model: save() + next step"] - plain) / plain
        write_cost = (med["the 2 steps after that (the write goes on)"] - 2 * plain) / plain
    return {
        # what the save blocks the loop for (the target), then what its background copy
        # and write take from the next steps on a machine whose cores all train
        "async save blocks the step / training step (lower is better; target <= 0.05)": (
            None if blocked is None else round(blocked, 4)
        ),
        "the next step's extra time while the copy and write run, in steps": (
            None if stall is None else round(stall, 4)
        ),
        "background write's cost to the 2 steps after, in steps (no spare core here)": (
            None if write_cost is None else round(write_cost, 4)
        ),
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
        "file_mb": file_mb,
        "ranks": ranks,
        "ratios (higher is better; targets: save >= 0.8, load >= 0.5)": {
            k: round(v, 3) for k, v in ratios.items()
        },
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
    print(f"{'operation':<44} {'seconds':>9} {'MB/s':>9}")
    for name, r in report["results"].items():
        print(f"{name:<44} {r['median_s']:>9.3f} {r['mb_per_s']:>9.0f}")
    blocked = next((v for k, v in report.items() if k.startswith("async save blocks")), None)
    if blocked is not None:
        print(f"async save blocks the step / training step: {blocked:.4f} (target <= 0.05)")
    for title, ratios in report.items():
        if title.startswith("ratios"):
            print(title)
            for name, value in ratios.items():
                print(f"  {name:<58} {value:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300.0, help="state size in MB (default 300)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per operation (median shown)")
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    ap.add_argument(
        "--ranks", type=int, default=2, help="ranks of the sharded rows (mpirun; 1: none)"
    )
    ap.add_argument("--quick", action="store_true", help="20 MB of state, one run per operation")
    ap.add_argument("--sharded-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeat = 20.0, 1
    if args.sharded_worker:  # one rank of run_sharded's mpirun
        rows = sharded_rows(args.mb, max(1, args.repeat), Path(args.sharded_worker))
        if args.json and int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(rows))
        return 0
    base = Path(tempfile.mkdtemp(prefix="hpctrain-bench-", dir=args.dir))
    try:
        report = run(args.mb, max(1, args.repeat), base, args.ranks)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
