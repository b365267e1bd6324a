"""Pipeline parallelism benchmark: bubble vs micro-batches, throughput, activation memory.

    .venv/bin/python benchmarks/bench_pipeline.py [--quick] [--json OUT.json] [--plot OUT.png]

Self-contained: starts its own `mpirun` jobs (each under a hard timeout) that run
hpctrain's PipelineTrainer / Trainer in a worker mode of this same file, on the fixed
random batch of `data.source: benchmark`, and reports:

- bubble fraction (idle share of a step, mean over stages) of P=2 stages for
  m in {1, 2, 4, 8, 16} micro-batches at a fixed global batch, measured against the
  theory (P-1)/(m+P-1), as JSON and as a PNG plot;
- throughput of the P=2 pipeline against single-process training of the same model on
  the same global batch (the single process gets both cores as threads);
- peak activation memory of 1F1B against GPipe: micro-batches held per stage (counted
  by the stages) times the bytes of one micro-batch's boundary activations, and each
  rank's peak RSS.
The first step of every run is a warm-up and is left out of the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MICRO = [1, 2, 4, 8, 16]


def model_overrides(quick: bool) -> list[str]:
    hidden = [512] * 4 if quick else [1024] * 4
    return [
        "model.name=mlp",
        f"model.hidden={json.dumps(hidden)}",
        "data.source=benchmark",
        "data.task=vectors",
        f"data.features={hidden[0]}",
        "metrics.tensorboard=false",
        "train.log_every=1",
        "optimizer.lr_scaling=none",
    ]


# --- worker mode (inside mpirun) -----------------------------------------------------------
def worker(out: str, runs: list[list[str]]) -> None:
    from hpctrain import Config, TrainingLoop
    from hpctrain.runtime import run_fail_together

    def main():
        results = []
        for overrides in runs:
            cfg = Config.load(None, overrides)
            run_dir = tempfile.mkdtemp(prefix="bench-pipe-")
            trainer = TrainingLoop(cfg, run_dir=run_dir)
            summary = trainer.fit()
            w = trainer.world
            rss = w.gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            if cfg.strategy == "pipeline":
                link = trainer.strategy.link
                shapes = [link.in_shape, link.out_shape]
                boundary = sum(4 * _prod(s) for s in shapes if s is not None)
                per_stage = w.gather_object(boundary)
            if w.rank == 0:
                lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
                steps = [json.loads(x) for x in lines]
                steps = [s for s in steps if s["event"] == "step"][1:]  # drop the warm-up
                rec = {"overrides": overrides, "summary": summary, "peak_rss_mb": rss}
                rec["samples_per_sec"] = sum(s["samples_per_sec"] for s in steps) / len(steps)
                if cfg.strategy == "pipeline":
                    busy = [sum(s["stage_busy_sec"][i] for s in steps) for i in range(2)]
                    idle = [sum(s["stage_idle_sec"][i] for s in steps) for i in range(2)]
                    rec["bubble_measured"] = sum(
                        i / (b + i) for b, i in zip(busy, idle, strict=True)
                    ) / len(busy)
                    rec["boundary_bytes_per_micro"] = per_stage[:2]
                    rec["peak_activation_bytes"] = [
                        n * b
                        for n, b in zip(
                            summary["stage_peak_microbatches"], per_stage[:2], strict=True
                        )
                    ]
                results.append(rec)
        if trainer.world.rank == 0:
            Path(out).write_text(json.dumps(results))

    sys.exit(run_fail_together(main))


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# --- driver ----------------------------------------------------------------------------------
def mpirun(np_: int, out: Path, runs: list[list[str]], timeout: float) -> list[dict]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "-np", str(np_), PY, __file__, "--worker", str(out), json.dumps(runs)]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    print(f"  mpirun -np {np_}: {len(runs)} run(s) in {time.monotonic() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())


def bench(quick: bool, backend: str) -> dict:
    global_batch, steps = (128, 4) if quick else (256, 6)
    base = [*model_overrides(quick), f"backend={backend}", f"train.max_steps={steps}"]
    base.append(f"data.train_samples={global_batch * steps}")
    pipe = [*base, "strategy=pipeline", "pipeline.stages=2"]
    # 1F1B at m=16 runs first in its job and GPipe at m=16 in a job of its own, so each
    # one's peak RSS (a per-process high-water mark) is its own.
    runs = [
        [*pipe, f"pipeline.microbatches={m}", f"train.batch_size={global_batch // m}"]
        for m in sorted(MICRO, reverse=True)
    ]
    gpipe_run = runs[0] + ["pipeline.schedule=gpipe"]
    single = [*base, f"train.batch_size={global_batch}"]
    with tempfile.TemporaryDirectory() as tmp:
        res = mpirun(2, Path(tmp) / "pipe.json", runs, 900)
        gpipe = mpirun(2, Path(tmp) / "gpipe.json", [gpipe_run], 300)[0]
        ref = mpirun(1, Path(tmp) / "single.json", [single], 300)[0]
    one_f = {r["summary"]["microbatches"]: r for r in res}
    bubble = [
        {
            "microbatches": m,
            "measured": round(one_f[m]["bubble_measured"], 4),
            "theory": round((2 - 1) / (m + 2 - 1), 4),
            "samples_per_sec": round(one_f[m]["samples_per_sec"], 1),
        }
        for m in MICRO
    ]
    best = max(bubble, key=lambda b: b["samples_per_sec"])
    return {
        "benchmark": "pipeline",
        "quick": quick,
        "backend": backend,
        "model": f"mlp {model_overrides(quick)[1]}",
        "global_batch": global_batch,
        "stages": 2,
        "bubble_vs_microbatches": bubble,
        "throughput": {
            "single_process_samples_per_sec": round(ref["samples_per_sec"], 1),
            "pipeline_p2_samples_per_sec": best["samples_per_sec"],
            "pipeline_p2_microbatches": best["microbatches"],
            "speedup": round(best["samples_per_sec"] / ref["samples_per_sec"], 3),
        },
        "activation_memory_m16": {
            "1f1b_peak_microbatches": one_f[16]["summary"]["stage_peak_microbatches"],
            "gpipe_peak_microbatches": gpipe["summary"]["stage_peak_microbatches"],
            "1f1b_peak_activation_bytes": one_f[16]["peak_activation_bytes"],
            "gpipe_peak_activation_bytes": gpipe["peak_activation_bytes"],
            "1f1b_peak_rss_mb": [round(x, 1) for x in one_f[16]["peak_rss_mb"]],
            "gpipe_peak_rss_mb": [round(x, 1) for x in gpipe["peak_rss_mb"]],
            "gpipe_samples_per_sec": round(gpipe["samples_per_sec"], 1),
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["bubble_vs_microbatches"]
    m = [r["microbatches"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(m, [r["measured"] for r in rows], "o-", label="measured (1F1B)")
    ax.plot(m, [r["theory"] for r in rows], "s--", label="theory (P-1)/(m+P-1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(m, [str(x) for x in m])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, 1)
    ax.set_title(f"P=2 pipeline, {result['backend']}, global batch {result['global_batch']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    ap.add_argument("--backend", default="torch", choices=("torch", "tensorflow"))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="PNG of bubble vs m (default: next to --json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        worker(args.worker, json.loads(rest[0]))
        return 0
    result = bench(args.quick, args.backend)
    png = args.plot or (args.json.with_suffix(".png") if args.json else Path("bench_pipeline.png"))
    plot(result, png)
    result["plot"] = str(png)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
