"""Time to accuracy on the demo task over a shaped network, method by method.

Two emulated nodes x 1 rank (`hpctrain.cluster`, needs root), links shaped with tc. The
demo's task and recipe (`configs/demo.yaml`: a synthetic teacher's labels, Adam, batch
128 per rank, warm-up then cosine) with the network section's wider mlp (hidden 1024 x
1024: 4.4 MB of gradients, so the link matters) for 4 epochs, trained by hpctrain with
each exchange method, beside raw Horovod with
and without `Compression.fp16` on the same data, model and schedule
(`benchmarks/baselines/raw_horovod_demo.py`). Reported per link: wall time from the
first step to the first epoch whose validation accuracy reaches TARGET, the epoch, and
the final accuracy. (The demo's own mlp has 0.3 MB of gradients: at 1 Gbit/s its step
is a few ms of communication and hpctrain's per-step bookkeeping, not a network test.)
"""

from __future__ import annotations

import json
import os

from .. import common

TITLE = "Time to accuracy on the demo task over the network"
TARGET = 0.80  # the demo's own bar (tests/test_compression_jobs.py: dense ends > 0.8)
MPI = ["train.allreduce=mpi"]
METHODS = {
    "dense": ("hpctrain mpi (dense float32)", MPI),
    "bf16": ("hpctrain bf16 ring", [*MPI, "train.compression=bf16"]),
    "topk": ("hpctrain top-k 1% + EF", [*MPI, "train.compression=topk", "compression.ratio=0.01"]),
    "powersgd": ("hpctrain PowerSGD r=4 + EF", [*MPI, "train.compression=powersgd"]),
    "local4": ("hpctrain local SGD H=4", [*MPI, "train.sync_every=4"]),
}
BASELINES = {"raw_horovod": "raw Horovod", "raw_horovod_fp16": "raw Horovod, Compression.fp16"}


def plan(quick: bool) -> dict:
    links = os.environ.get("HPCTRAIN_BENCH_LINKS")
    return {
        "links": links.split(",") if links else (["1gbit"] if quick else ["1gbit", "10gbit"]),
        "methods": ["dense", "topk"] if quick else list(METHODS),
        "baselines": ["raw_horovod"] if quick else list(BASELINES),
        "epochs": 4,
        "hidden": [1024, 1024],
        "target": TARGET,
    }


def _epochs_of_hpctrain(run_dir) -> list[dict]:
    """[{epoch, seconds since the first step, val_accuracy}] from metrics.jsonl."""
    try:
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []
    summary = next((r for r in records if r.get("event") == "summary"), None)
    if summary is None:
        return []
    start = summary["time"] - summary["elapsed_sec"]
    return [
        {"epoch": r["epoch"] + 1, "seconds": r["time"] - start, "val_accuracy": r["val_accuracy"]}
        for r in records
        if r.get("event") == "epoch" and r.get("val_accuracy") is not None
    ]


def _run(ctx, cluster, name, link, p, method=None, baseline=None) -> dict:
    from hpctrain.cluster import mpirun_args

    work = ctx.scratch(f"convergence-{name}-{link}")
    for old in ("metrics.jsonl", "out.json"):
        (work / old).unlink(missing_ok=True)
    if method is not None:
        sets = [
            "runtime.threads=1",
            "metrics.tensorboard=false",
            "metrics.progress_bar=false",
            f"train.epochs={p['epochs']}",
            "model.hidden=[" + ",".join(map(str, p["hidden"])) + "]",
            *METHODS[method][1],
        ]
        args = [common.HPCTRAIN, "train", "--config", "configs/demo.yaml"]
        args += ["--run-dir", str(work), "--new"]
        for s in sets:
            args += ["--set", s]
    else:
        args = [common.PYTHON, "benchmarks/baselines/raw_horovod_demo.py"]
        args += ["--epochs", str(p["epochs"]), "--json", str(work / "out.json")]
        args += ["--hidden", ",".join(map(str, p["hidden"]))]
        if baseline == "raw_horovod_fp16":
            args.append("--fp16")
    job = common.mpirun(
        ctx,
        2,
        args,
        timeout=120 + 40 * p["epochs"],
        mpi_args=mpirun_args(cluster.plan, cluster.agent),
    )
    if method is not None:
        epochs = _epochs_of_hpctrain(work)
    else:
        epochs = (common.read_json(work / "out.json") or {}).get("epochs", [])
    reached = next((e for e in epochs if e["val_accuracy"] >= p["target"]), None)
    return {
        "name": name,
        "label": METHODS[method][0] if method else BASELINES[baseline],
        "link": link,
        "epochs": epochs,
        "reached": reached,
        "ok": job.ok and bool(epochs),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def run(ctx) -> dict:
    from hpctrain.cluster import ClusterUnavailable, session

    p = plan(ctx.quick)
    links = []
    try:
        with session(nodes=2, wait=300, what="make bench (convergence section)") as cluster:
            for link in p["links"]:
                cluster.shape(link)
                rows = [_run(ctx, cluster, m, link, p, method=m) for m in p["methods"]]
                rows += [_run(ctx, cluster, b, link, p, baseline=b) for b in p["baselines"]]
                links.append({"link": link, "rows": rows})
    except ClusterUnavailable as exc:
        return {"skipped": str(exc), "plan": p}
    return {"plan": p, "links": links}


def markdown(data, ctx) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}\n"
    p = data["plan"]
    out = [
        f"2 emulated nodes x 1 rank, each node on its own core; the demo's task and recipe "
        f"(configs/demo.yaml, batch 128/rank) with mlp hidden {p['hidden']} "
        f"(4.4 MB of gradients), {p['epochs']} epochs. Time = wall seconds from the first step to "
        f"the end of the first epoch whose validation accuracy is >= {p['target']:.2f} "
        "(evaluation included); vs dense = dense time / this time.\n",
        "| link | method | time to target (s) | epoch | vs dense | final accuracy | all epochs (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for entry in data["links"]:
        by = {r["name"]: r for r in entry["rows"]}
        dense = (by.get("dense", {}).get("reached") or {}).get("seconds")
        for r in entry["rows"]:
            if not r.get("ok"):
                out.append(f"| {entry['link']} | {r['label']} | failed | | | | |")
                continue
            last = r["epochs"][-1]
            hit = r["reached"]
            when = f"{hit['seconds']:.1f}" if hit else "not reached"
            epoch = str(hit["epoch"]) if hit else ""
            vs = f"{dense / hit['seconds']:.2f}x" if hit and dense else ""
            out.append(
                f"| {entry['link']} | {r['label']} | {when} | {epoch} | {vs} | "
                f"{last['val_accuracy']:.4f} | {last['seconds']:.1f} |"
            )
    return "\n".join(out) + "\n"


def plots(data, ctx) -> list[str]:
    """Validation accuracy against wall time, one panel per link, the target dashed."""
    if "skipped" in data or not data.get("links"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data["links"])
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4), squeeze=False)
    for ax, entry in zip(axes[0], data["links"], strict=True):
        for r in entry["rows"]:
            if r.get("ok") and r["epochs"]:
                seconds = [e["seconds"] for e in r["epochs"]]
                ax.plot(seconds, [e["val_accuracy"] for e in r["epochs"]], "o-", label=r["label"])
        ax.axhline(data["plan"]["target"], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(f"{entry['link']}: 2 nodes x 1 rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = "convergence_accuracy.png"
    fig.savefig(ctx.out / name, dpi=110)
    plt.close(fig)
    return [name]
