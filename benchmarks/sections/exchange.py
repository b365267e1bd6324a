"""Gradient exchange methods over a shaped network: which one to pick for which link.

Two emulated nodes (`hpctrain.cluster`, needs root), 1 rank each, links shaped with tc,
the network section's workload (mlp, 5.3 MB of float32 gradients). Side by side in one
run per link: hpctrain's dense engines (sync `mpi`, `overlap`), the 16-bit rings, top-k
1% and PowerSGD r=4 (error feedback on), int8, local SGD H=4, torch DDP over Gloo, and
raw Horovod with and without `Compression.fp16`. Reported: step time and throughput
relative to hpctrain's dense sync engine and to DDP, beside the physical limit: the
same steps with no exchange at all (compute alone). Each node owns its cores (one each
on a 2-core machine; `hpctrain cluster`'s cpusets). Accuracy of each method after the
same epochs is proven by the tests (tests/test_compression_jobs.py,
tests/test_local_sgd_jobs.py), not here.

Then the dense engines on `deepmlp` (the same 5.3 MB of gradients over five equal
layers): in the mlp 80% of the bytes are one matrix finished only at the end of
backward, which bounds what any overlapping engine (DDP's too) can hide; spread over
layers, buckets travel while backward goes on.

Then 2 nodes x 2 ranks: flat MPI_Allreduce vs `train.hierarchical` per message size.
"""

from __future__ import annotations

import os

from .. import common
from ..workloads import BATCH
from . import scaling

TITLE = "Gradient exchange methods over the network"
MODEL = "mlp"
METHODS = {
    "dense": ("hpctrain mpi (dense float32)", ["train.allreduce=mpi"]),
    "overlap": ("hpctrain overlap (dense, buckets)", ["train.allreduce=overlap"]),
    "fp16": ("hpctrain fp16 ring", ["train.allreduce=mpi", "train.compression=fp16"]),
    "bf16": ("hpctrain bf16 ring", ["train.allreduce=mpi", "train.compression=bf16"]),
    "topk": (
        "hpctrain top-k 1% + EF",
        ["train.allreduce=mpi", "train.compression=topk", "compression.ratio=0.01"],
    ),
    "powersgd": (
        "hpctrain PowerSGD r=4 + EF",
        ["train.allreduce=mpi", "train.compression=powersgd", "compression.rank=4"],
    ),
    "int8": ("hpctrain int8 + EF", ["train.allreduce=mpi", "train.compression=int8"]),
    "local4": ("hpctrain local SGD H=4", ["train.allreduce=mpi", "train.sync_every=4"]),
    # The physical limit of any method: the same steps with no exchange at all (local SGD
    # whose averaging falls after the measured steps).
    "compute": ("compute alone (no exchange)", ["train.allreduce=mpi", "train.sync_every=100000"]),
}
BASELINES = {
    "ddp_gloo": "torch DDP (Gloo)",
    "raw_horovod": "raw Horovod",
    "raw_horovod_fp16": "raw Horovod, Compression.fp16",
}


def plan(quick: bool) -> dict:
    links = os.environ.get("HPCTRAIN_BENCH_LINKS")
    return {
        "links": links.split(",") if links else (["1gbit"] if quick else ["1gbit", "10gbit"]),
        "methods": ["dense", "fp16", "topk", "compute"] if quick else list(METHODS),
        "baselines": ["ddp_gloo"] if quick else list(BASELINES),
        "spread": {  # the dense engines on the model whose bytes are spread over layers
            "model": "deepmlp",
            "methods": ["dense", "overlap", "compute"],
            "baselines": ["ddp_gloo"] if quick else ["ddp_gloo", "raw_horovod"],
        },
        "warmup": 3 if quick else 5,
        "iters": 3 if quick else 5,
        "batches": 4 if quick else 6,
        "hier_sizes_mb": "1,4" if quick else "1,4,16",
    }


def _mpi(cluster, per_node: int) -> list[str]:
    from hpctrain.cluster import mpirun_args

    return mpirun_args(cluster.plan, cluster.agent, per_node=per_node)


def _step(ctx, cluster, name, link, p, method=None, baseline=None, model=MODEL) -> dict:
    work = ctx.scratch(f"exchange-{model}-{name}-{link}")
    for old in ("metrics.jsonl", "out.json"):
        (work / old).unlink(missing_ok=True)
    if method is not None:
        args = scaling.hpctrain_args(
            "torch",
            model,
            2,
            p["warmup"],
            p["iters"],
            p["batches"],
            work,
            extra=METHODS[method][1],
        )
    else:
        kind = "raw_horovod" if baseline.startswith("raw_horovod") else baseline
        args = scaling.baseline_args(
            kind, "torch", model, p["warmup"], p["iters"], p["batches"], work / "out.json"
        )
        if baseline == "raw_horovod_fp16":
            args.append("--fp16")
    steps = p["warmup"] + p["iters"] * p["batches"]
    job = common.mpirun(ctx, 2, args, timeout=150 + 2.0 * steps, mpi_args=_mpi(cluster, 1))
    if method is not None:
        rates = scaling.hpctrain_iterations(work, p["warmup"], p["batches"])
    else:
        rates = (common.read_json(work / "out.json") or {}).get("img_secs", [])
    seconds = [BATCH / r for r in rates if r]
    return {
        "name": name,
        "label": METHODS[method][0] if method else BASELINES[baseline],
        "link": link,
        "step": common.mean_conf(seconds),
        "ok": job.ok and bool(seconds),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def _hierarchical(ctx, cluster, p) -> dict:
    out = ctx.scratch("exchange-hierarchical") / "h.json"
    out.unlink(missing_ok=True)
    args = [
        common.PYTHON,
        "benchmarks/workers/hier_allreduce.py",
        "--sizes-mb",
        p["hier_sizes_mb"],
        "--json",
        str(out),
    ]
    job = common.mpirun(ctx, 4, args, timeout=300, mpi_args=_mpi(cluster, 2))
    data = common.read_json(out) or {}
    return {
        "ok": job.ok and bool(data),
        "rows": data.get("rows", []),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def run(ctx) -> dict:
    from hpctrain.cluster import ClusterUnavailable, session

    p = plan(ctx.quick)
    links = []
    try:
        with session(nodes=2, wait=300, what="make bench (exchange section)") as cluster:
            for link in p["links"]:
                cluster.shape(link)
                rows = [_step(ctx, cluster, m, link, p, method=m) for m in p["methods"]]
                rows += [_step(ctx, cluster, b, link, p, baseline=b) for b in p["baselines"]]
                links.append({"link": link, "model": MODEL, "rows": rows})
                sp = p["spread"]
                rows = [
                    _step(ctx, cluster, m, link, p, method=m, model=sp["model"])
                    for m in sp["methods"]
                ]
                rows += [
                    _step(ctx, cluster, b, link, p, baseline=b, model=sp["model"])
                    for b in sp["baselines"]
                ]
                links.append({"link": link, "model": sp["model"], "rows": rows})
            cluster.shape("1gbit")
            hier = _hierarchical(ctx, cluster, p)
    except ClusterUnavailable as exc:
        return {"skipped": str(exc), "plan": p}
    return {"plan": p, "links": links, "hierarchical": hier}


def _mean(row):
    return row["step"]["mean"] if row.get("ok") and row.get("step") else None


def markdown(data, ctx) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}\n"
    out = [
        "2 emulated nodes x 1 rank, torch, batch 64/rank, one "
        "compute thread, each node on its own core. Step = per-iteration mean (ms). vs dense "
        "= hpctrain's dense sync step / this step (throughput ratio); vs DDP = DDP's step / "
        "this step; of limit = compute alone / this step (1.00 = no time spent on the "
        "exchange).\n",
        "mlp = 256-1024-1024-10; deepmlp = 512-5x512-10; both 5.3 MB of gradients.\n",
        "| link | model | method | step (ms) | vs dense | vs DDP | of limit | other load |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for entry in data["links"]:
        by = {r["name"]: r for r in entry["rows"]}
        dense, ddp = _mean(by.get("dense", {})), _mean(by.get("ddp_gloo", {}))
        limit = _mean(by.get("compute", {}))
        model = entry.get("model", MODEL)
        for r in entry["rows"]:
            m = _mean(r)
            if m is None:
                out.append(f"| {entry['link']} | {model} | {r['label']} | failed | | | | |")
                continue
            vs_dense = f"{dense / m:.2f}x" if dense else ""
            vs_ddp = f"{ddp / m:.2f}x" if ddp else ""
            of_limit = f"{limit / m:.2f}" if limit else ""
            load = r.get("foreign_load")
            shown = f"{load:.2f}" if load is not None else ""
            out.append(
                f"| {entry['link']} | {model} | {r['label']} | {m * 1e3:.1f} | {vs_dense} | "
                f"{vs_ddp} | "
                f"{of_limit} | {shown} |"
            )
    hier = data.get("hierarchical", {})
    out += [
        "",
        "**Hierarchical allreduce**, 2 nodes x 2 ranks over 1 Gbit/s (median ms per call):",
        "",
        "| size (MB) | flat MPI_Allreduce | hierarchical | flat / hierarchical |",
        "|---:|---:|---:|---:|",
    ]
    for r in hier.get("rows", []):
        out.append(
            f"| {r['bytes'] / 2**20:.0f} | {r['flat'] * 1e3:.1f} | {r['hierarchical'] * 1e3:.1f} "
            f"| {r['flat'] / r['hierarchical']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def plots(data, ctx) -> list[str]:
    if "skipped" in data or not data.get("links"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["links"]), figsize=(6 * len(data["links"]), 4))
    axes = axes if len(data["links"]) > 1 else [axes]
    for ax, entry in zip(axes, data["links"], strict=True):
        rows = [r for r in entry["rows"] if _mean(r) is not None]
        ax.barh([r["label"] for r in rows], [_mean(r) * 1e3 for r in rows])
        ax.set_xlabel("step (ms)")
        ax.set_title(f"{entry['link']}, {entry.get('model', MODEL)}: 2 nodes x 1 rank")
    fig.tight_layout()
    name = "exchange_steps.png"
    fig.savefig(ctx.out / name, dpi=110)
    plt.close(fig)
    return [name]
