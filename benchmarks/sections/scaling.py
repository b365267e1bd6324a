"""Data-parallel weak scaling: hpctrain vs raw Horovod vs a synchronous mpi4py loop.

Why: the one number an HPC user asks first is how throughput grows with ranks, and
whether the framework costs anything over the simplest code that does the same thing.
Every contender trains the same zoo model on the same fixed random batch per rank
(Horovod's synthetic benchmark) with one compute thread per rank, so a rank is one
core's worth of work and T(1) is one core. Per-iteration img/s after warm-up, reported
as Horovod does (mean ± 1.96·std); efficiency = T(N) / (N·T(1)).
"""

from __future__ import annotations

import json

from .. import common
from ..workloads import BATCH, WORKLOADS

TITLE = "Data-parallel scaling"
CONTENDERS = {
    "hpctrain": "hpctrain train",
    "raw_horovod": "raw Horovod (defaults)",
    "mpi4py": "mpi4py Allreduce (sync)",
    "ddp_gloo": "torch DDP (Gloo)",
}
BASELINE_SCRIPT = {
    ("raw_horovod", "torch"): ["benchmarks/baselines/raw_horovod_torch.py"],
    ("raw_horovod", "tensorflow"): ["benchmarks/baselines/raw_horovod_tf.py"],
    ("mpi4py", "torch"): ["benchmarks/baselines/mpi4py_allreduce.py", "--backend", "torch"],
    ("ddp_gloo", "torch"): ["benchmarks/baselines/ddp_gloo.py"],
    ("mpi4py", "tensorflow"): [
        "benchmarks/baselines/mpi4py_allreduce.py",
        "--backend",
        "tensorflow",
    ],
}


def plan(quick: bool) -> dict:
    """What to run: models, rank counts, iterations (Horovod's 10 x 10 after 10 warm-up)."""
    if quick:
        return {
            "models": ["cnn"],
            "backends": ["torch", "tensorflow"],
            "ranks": [1, 2],
            "warmup": 5,
            "iters": 6,
            "batches": {"cnn": 5},
            "baseline_models": {"torch": ["cnn"], "tensorflow": []},
            "baseline_ranks": [1, 2],
        }
    return {
        "models": ["cnn", "resnet", "mlp"],
        "backends": ["torch", "tensorflow"],
        "ranks": [1, 2, 4],
        "warmup": 10,
        "iters": 10,
        "batches": {"cnn": 10, "resnet": 4, "mlp": 10},
        # baselines where they answer a question: every torch model, TF's cnn, and not on
        # the oversubscribed np=4 (keeps `make bench` under 15 minutes on 2 cores)
        "baseline_models": {"torch": ["cnn", "resnet", "mlp"], "tensorflow": ["cnn"]},
        "baseline_ranks": [1, 2],
    }


def contenders(p, backend, model, np_) -> list[str]:
    """Who runs at this point of the plan: hpctrain always, baselines where planned."""
    if model in p["baseline_models"][backend] and np_ in p["baseline_ranks"]:
        return [k for k in CONTENDERS if k == "hpctrain" or (k, backend) in BASELINE_SCRIPT]
    return ["hpctrain"]


def hpctrain_args(backend, model, np_, warmup, iters, batches, run_dir, extra=()) -> list[str]:
    """`hpctrain train` on the benchmark data, one step record per iteration."""
    steps = warmup + iters * batches
    sets = [
        f"backend={backend}",
        "data.source=benchmark",
        f"data.train_samples={BATCH * np_ * steps}",
        f"train.batch_size={BATCH}",
        f"train.max_steps={steps}",
        f"train.log_every={batches}",
        "runtime.threads=1",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        *WORKLOADS[model].hpctrain_sets(),
        *extra,
    ]
    args = [common.HPCTRAIN, "train", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return args


def hpctrain_iterations(run_dir, warmup: int, batches: int) -> list[float]:
    """Per-rank img/s of each iteration, from the `time` of consecutive step records."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = [json.loads(s) for s in lines]
    steps = [r for r in steps if r.get("event") == "step" and r["step"] >= warmup]
    out = []
    for a, b in zip(steps, steps[1:]):
        dt = b["time"] - a["time"]
        if b["step"] > a["step"] and dt > 0:  # a second run in the same folder restarts
            out.append(BATCH * (b["step"] - a["step"]) / dt)
    return out


def baseline_args(kind, backend, model, warmup, iters, batches, json_out) -> list[str]:
    return [
        common.PYTHON,
        *BASELINE_SCRIPT[(kind, backend)],
        *WORKLOADS[model].baseline_args(),
        "--batch-size",
        str(BATCH),
        "--num-warmup-batches",
        str(warmup),
        "--num-batches-per-iter",
        str(batches),
        "--num-iters",
        str(iters),
        "--threads",
        "1",
        "--json",
        str(json_out),
    ]


def measure(
    ctx, kind, backend, model, np_, p, env=None, extra=(), tag="", sample_threads=False
) -> dict:
    """One contender at one rank count: per-iteration per-rank img/s and the job record."""
    batches = p["batches"][model]
    if np_ > ctx.cores:  # each step takes ~np/cores times longer: keep the run's length
        batches = max(2, batches * ctx.cores // np_)
    name = f"{kind}-{backend}-{model}-np{np_}{tag}"
    work = ctx.scratch(name)
    for old in ("metrics.jsonl", "out.json"):  # never read an earlier run's numbers
        (work / old).unlink(missing_ok=True)
    if kind == "hpctrain":
        args = hpctrain_args(backend, model, np_, p["warmup"], p["iters"], batches, work, extra)
    else:
        args = baseline_args(
            kind, backend, model, p["warmup"], p["iters"], batches, work / "out.json"
        ) + list(extra)
    steps = p["warmup"] + p["iters"] * batches
    timeout = 120 + steps * (3.0 if model == "resnet" else 1.0) * max(1, np_ / ctx.cores)
    job = common.mpirun(ctx, np_, args, timeout=timeout, env=env, sample_threads=sample_threads)
    if kind == "hpctrain":
        values = hpctrain_iterations(work, p["warmup"], batches)
    else:
        values = (common.read_json(work / "out.json") or {}).get("img_secs", [])
    per_rank = common.mean_conf(values)
    total = None
    if per_rank["mean"] is not None:
        total = {"mean": per_rank["mean"] * np_, "conf": per_rank["conf"] * np_}
    return {
        "contender": kind,
        "backend": backend,
        "model": model,
        "np": np_,
        "oversubscribed": np_ > ctx.cores,
        "iterations": values,
        "per_rank": per_rank,
        "total": total,
        "ok": job.ok and per_rank["n"] > 0,
        "foreign_load": job.foreign_load,
        "threads": job.threads,
        "command": job.record()["command"],
        "env": env or {},
    }


def run(ctx) -> dict:
    p = plan(ctx.quick)
    rows = []
    for backend in p["backends"]:
        for model in p["models"]:
            for np_ in p["ranks"]:
                for kind in contenders(p, backend, model, np_):
                    rows.append(measure(ctx, kind, backend, model, np_, p))
    _derive(rows)
    return {
        "plan": p,
        "workloads": {m: WORKLOADS[m].describe() for m in p["models"]},
        "rows": rows,
    }


def find(rows, kind, backend, model, np_):
    for r in rows:
        if (r["contender"], r["backend"], r["model"], r["np"]) == (kind, backend, model, np_):
            return r
    return None


def _derive(rows) -> None:
    """Weak-scaling efficiency vs the same contender's np=1, and hpctrain's ratios."""
    for r in rows:
        one = find(rows, r["contender"], r["backend"], r["model"], 1)
        r["efficiency"] = None
        if one and one["per_rank"]["mean"] and r["per_rank"]["mean"]:
            # T(N) / (N·T(1)) = per-rank(N) / per-rank(1)
            r["efficiency"] = common.ratio(r["per_rank"], one["per_rank"])
        if r["contender"] == "hpctrain":
            for other in ("raw_horovod", "mpi4py"):
                o = find(rows, other, r["backend"], r["model"], r["np"])
                r[f"vs_{other}"] = common.ratio(r["total"], o["total"]) if o else None


def markdown(data, ctx) -> str:
    rows = data["rows"]
    out = [
        "Per-rank batch fixed at "
        f"{BATCH}, one compute thread per rank, fixed random batch (Horovod's synthetic "
        "benchmark). Img/sec per rank is the mean ± 1.96·std over iterations after "
        "warm-up; total = N × per rank; efficiency = T(N) / (N·T(1)) against the same "
        "contender at np=1. One run per point: at np=2 whole runs differ by up to ~20% "
        "(see the ablation's run means), more than the iterations of one run do. "
        "`other load` is the mean number of cores busy with processes outside the "
        "benchmark while the job ran (the machine is shared): above ~0.3 the figure is "
        "depressed by others, np=2 more than np=1.",
        "",
    ]
    for model, desc in data["workloads"].items():
        out.append(f"- **{model}**: {desc}")
    out.append("")
    out.append(
        "| backend | model | np | contender | img/s per rank | total img/s | efficiency "
        "| hpctrain / raw Horovod | hpctrain / mpi4py | other load |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        np_txt = f"{r['np']} (oversubscribed)" if r["oversubscribed"] else str(r["np"])
        vs_h = common.fmt_ratio(r.get("vs_raw_horovod")) if r["contender"] == "hpctrain" else ""
        vs_m = common.fmt_ratio(r.get("vs_mpi4py")) if r["contender"] == "hpctrain" else ""
        load = "" if r["foreign_load"] is None else f"{r['foreign_load']:.2f}"
        status = "" if r["ok"] else " **FAILED**"
        out.append(
            f"| {r['backend']} | {r['model']} | {np_txt} | {CONTENDERS[r['contender']]}{status} "
            f"| {common.fmt_mc(r['per_rank'], 0)} | {common.fmt_mc(r['total'], 0)} "
            f"| {common.fmt_pct(r['efficiency'])} | {vs_h} | {vs_m} | {load} |"
        )
    out.append("")
    out.append(
        "Horovod's own output format, for hpctrain (the lines its synthetic benchmark "
        "prints on rank 0):"
    )
    out.append("")
    out.append("```")
    for r in rows:
        if r["contender"] == "hpctrain" and r["per_rank"]["mean"]:
            pr, tot = r["per_rank"], r["total"]
            out.append(
                f"[{r['backend']} {r['model']}] Img/sec per CPU: {pr['mean']:.1f} +-{pr['conf']:.1f}"
                f"   Total img/sec on {r['np']} CPU(s): {tot['mean']:.1f} +-{tot['conf']:.1f}"
            )
    out.append("```")
    return "\n".join(out)


def plots(data, ctx) -> list[str]:
    from .. import plots as P

    return P.scaling(data, ctx.out, CONTENDERS)
