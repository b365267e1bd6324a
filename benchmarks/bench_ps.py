"""Parameter-server benchmark: transport cost and time to a target loss.

1. Bandwidth: one push + pull round trip through the real PS code (a `Server` on rank 1,
   `Worker._exchange` on rank 0; a null model so only communication is timed) against
   a raw mpi4py `Send`/`Recv` ping-pong of the same bytes each way.
2. Time to reach a target training loss on the synthetic vectors task (MLP, Adam): Horovod
   allreduce (2 ranks) vs PS sync vs PS async (1 server + 2 workers, same global batch),
   each without and with one straggling worker (2x slower: it sleeps as long as it
   computed). The loss is rank 0's per-step training loss smoothed over 5 steps: the
   global batch's loss for allreduce, worker 0's own batch for the PS (same batch size).
   Times count from the first logged step, so start-up (imports, data) is excluded.

Standalone: runs its own mpirun jobs, each under a hard timeout, prints a table and with
`--json OUT` writes the figures. `--quick` uses fewer sizes, samples and repetitions.

    .venv/bin/python benchmarks/bench_ps.py --quick --json /tmp/ps.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
HPCTRAIN = str(Path(sys.executable).parent / "hpctrain")
ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PYTHONUNBUFFERED": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def mpirun(np_: int, args: list[str], timeout: float, env: dict | None = None) -> str:
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **ENV, **(env or {})},
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise SystemExit(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}") from None
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out


# --- inner jobs (run under mpirun) ----------------------------------------------------------
class _NullModel:
    name = "none"

    def set_params(self, arrays):
        pass


def inner_bandwidth(sizes_mb: list[float], reps: int, max_sleep_ms: float) -> None:
    """Rank 0 and rank 1: raw ping-pong, then PS push+pull, same bytes; rank 0 prints JSON."""
    from hpctrain import Config
    from hpctrain.runtime import world
    from hpctrain.strategies.ps.server import Server
    from hpctrain.strategies.ps.sharding import plan_shards
    from hpctrain.strategies.ps.worker import Worker

    w = world()
    comm = w.comm
    results = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 4
        buf = np.ones(n, np.float32)
        times = []
        for _ in range(reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            if w.rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=2)
            else:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=2)
            times.append(time.perf_counter() - t0)
        raw = float(np.median(times[1:]))
        cfg = Config.load(
            None,
            [
                "optimizer.momentum=0",
                "optimizer.lr=1e-9",
                "ps.heartbeat_timeout=60",
                "strategy=parameter_server",
                f"ps.poll_max_sleep_ms={max_sleep_ms}",
            ],
        )
        plan = plan_shards({"x": (n,)}, 1, 1 << 30)
        comm.Barrier()
        if w.rank == 1:
            stats = Server(w, 0, [0], np.zeros(n, np.float32), cfg, lambda v: 1e-9).run()
            comm.send(stats["cpu_seconds"] / stats["seconds"], dest=0, tag=3)
            ps = None
        else:
            worker = Worker(w, 0, [1], plan, _NullModel(), None, cfg, start_step=0, position=0)
            worker._exchange(push=False)
            ps_times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                worker._exchange(push=True)
                ps_times.append(time.perf_counter() - t0)
            from hpctrain.strategies.ps import protocol as P

            comm.Send(P.ctrl(P.DONE, 0), dest=1, tag=P.TAG_CTRL)
            ps = float(np.median(ps_times[1:]))
            server_cpu = comm.recv(source=1, tag=3)
        if w.rank == 0:
            moved = 2 * n * 4
            results.append(
                {
                    "megabytes_each_way": mb,
                    "raw_seconds": raw,
                    "ps_seconds": ps,
                    "raw_gbytes_per_sec": moved / raw / 1e9,
                    "ps_gbytes_per_sec": moved / ps / 1e9,
                    "ps_over_raw": ps / raw,
                    "poll_max_sleep_ms": max_sleep_ms,
                    "server_cpu_share": server_cpu,
                }
            )
    if w.rank == 0:
        print("BANDWIDTH " + json.dumps(results))


def inner_dp(out_dir: str, slow: float, overrides: list[str]) -> None:
    """Data-parallel (Horovod) training with rank 1 made `slow` times slower."""
    from hpctrain import Config, Trainer

    trainer = Trainer(Config.load(None, overrides), run_dir=out_dir)
    if trainer.world.rank == 1 and slow != 1.0:
        step, last = trainer.strategy.backend.train_step, [0.0]

        def slowed(micro, lr, tally=True):
            time.sleep((slow - 1.0) * last[0])
            t0 = time.perf_counter()
            stats = step(micro, lr, tally)
            last[0] = time.perf_counter() - t0 - stats.comm_seconds  # compute only
            return stats

        trainer.strategy.backend.train_step = slowed
    trainer.fit()


# --- the driver --------------------------------------------------------------------------------
def time_to_target(run_dir: Path, target: float, window: int = 5) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    steps = [x for x in lines if x["event"] == "step"]
    summary = [x for x in lines if x["event"] == "summary"][-1]
    t0 = steps[0]["time"]
    losses = np.array([x["loss"] for x in steps])
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    hit = np.nonzero(smooth <= target)[0]
    reached = None if not hit.size else steps[int(hit[0]) + window - 1]
    return {
        "seconds_to_target": None if reached is None else reached["time"] - t0,
        "step_at_target": None if reached is None else reached["step"],
        "final_smoothed_loss": float(smooth[-1]),
        "train_seconds": steps[-1]["time"] - t0,
        "val_accuracy": summary.get("val_accuracy"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes, samples, repetitions")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner == "bandwidth":
        inner_bandwidth([float(x) for x in args.rest[2:]], int(args.rest[0]), float(args.rest[1]))
        return
    if args.inner == "dp":
        inner_dp(args.rest[0], float(args.rest[1]), args.rest[2:])
        return

    quick = args.quick
    result = {"quick": quick, "load_before": os.getloadavg()[0], "cpus": os.cpu_count()}
    sizes = ["1", "8"] if quick else ["0.25", "1", "4", "16"]
    bw = []
    for max_sleep in ("1.0", "0"):  # the default backoff, and polling that never sleeps
        out = mpirun(
            2,
            [
                PYTHON,
                __file__,
                "--inner",
                "bandwidth",
                "--",
                "5" if quick else "20",
                max_sleep,
                *sizes,
            ],
            timeout=300,
        )
        bw += json.loads(out.split("BANDWIDTH ", 1)[1].splitlines()[0])
    result["bandwidth"] = bw
    print(
        f"{'MB each way':>12} {'max sleep':>9} {'raw GB/s':>9} {'PS GB/s':>9} "
        f"{'PS/raw time':>12} {'server CPU':>10}"
    )
    for r in bw:
        print(
            f"{r['megabytes_each_way']:>12} {r['poll_max_sleep_ms']:>9} "
            f"{r['raw_gbytes_per_sec']:>9.2f} {r['ps_gbytes_per_sec']:>9.2f} "
            f"{r['ps_over_raw']:>12.2f} {r['server_cpu_share']:>10.2f}"
        )

    target = 1.0 if quick else 0.8
    common = [
        "data.train_samples=" + ("8192" if quick else "16384"),
        "data.val_samples=2048",
        "train.epochs=2",
        "train.batch_size=64",
        "optimizer.name=adam",
        "optimizer.lr=0.002",
        "optimizer.lr_scaling=none",
        "metrics.tensorboard=false",
        "train.log_every=1",
        "data.prefetch=1",
    ]
    sets = [x for o in common for x in ("--set", o)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-ps-") as tmp:
        for slow in (1.0, 2.0):
            for name in ("horovod_allreduce", "ps_sync", "ps_async"):
                run = Path(tmp) / f"{name}-{slow}"
                t0 = time.monotonic()
                if name == "horovod_allreduce":
                    mpirun(
                        2,
                        [PYTHON, __file__, "--inner", "dp", "--", str(run), str(slow), *common],
                        timeout=600,
                    )
                else:
                    env = {"HPCTRAIN_FAULT_PS_SLOW": f"1:{slow}"} if slow != 1.0 else {}
                    mpirun(
                        3,
                        [
                            HPCTRAIN,
                            "ps",
                            "--run-dir",
                            str(run),
                            *sets,
                            "--set",
                            f"ps.mode={name[3:]}",
                        ],
                        timeout=600,
                        env=env,
                    )
                r = time_to_target(run, target)
                r["job_seconds"] = time.monotonic() - t0
                runs[f"{name}{'_straggler' if slow != 1.0 else ''}"] = r
                print(
                    f"{name:>18} straggler={slow != 1.0!s:5} to loss {target}: "
                    f"{r['seconds_to_target'] if r['seconds_to_target'] is None else round(r['seconds_to_target'], 2)} s "
                    f"(step {r['step_at_target']}), train {r['train_seconds']:.2f} s, "
                    f"val acc {r['val_accuracy']:.3f}",
                    flush=True,
                )
    result.update(target_loss=target, time_to_target=runs, load_after=os.getloadavg()[0])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
