"""Two nodes over a real (emulated) network: where the link, not the cores, decides.

Why: every other section runs on one node over shared memory, where communication is
nearly free. Here two network-namespace nodes (`hpctrain.cluster`, needs root) talk
over veth links shaped with tc to 1, 10 and 25 Gbit/s and unshaped, one rank per node,
and the mlp (5.3 MB of gradients) makes the step network-bound at 1 Gbit/s. For each
contender (hpctrain with each gradient engine, raw Horovod, the mpi4py loop, torch DDP
over Gloo) at each link: the step time; beside it the same step's compute alone (the
mpi4py loop without its Allreduce, on both nodes at once) and the communication alone
(MPI_Allreduce of the gradient bytes over that link). The overlap ratio
(compute + comm - step) / min(compute, comm) is 1 when the shorter of the two is
entirely hidden behind the longer, 0 when they run one after the other, below 0 when
the step costs more than both. α and β are fitted per link from the Allreduce sweep,
and the α–β projection of the step (compute + T(2, S), with and without overlap) is
compared with every measured step.
"""

from __future__ import annotations

import os

from .. import alphabeta as ab
from .. import common
from ..workloads import BATCH, WORKLOADS, gradient_tensors
from . import scaling

TITLE = "Two nodes over a shaped network"
MODEL = "mlp"
LINKS = ["1gbit", "10gbit", "25gbit", "none"]
LINK_LABEL = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "25gbit": "25 Gbit/s", "none": "unshaped"}
CONTENDERS = {
    "hpctrain_mpi": "hpctrain, train.allreduce=mpi",
    "hpctrain_overlap": "hpctrain, train.allreduce=overlap",
    "hpctrain_horovod": "hpctrain, train.allreduce=horovod",
    "raw_horovod": "raw Horovod (defaults)",
    "mpi4py": "mpi4py Allreduce (sync)",
    "ddp_gloo": "torch DDP (Gloo)",
}
# The Allreduce sweep measures the network, not the scheduler: ranks yield the core while
# they wait, so another process on the shared machine cannot stretch a wait by a time slice.
# Two TCP connections per peer, as hpctrain sets (runtime.tcp_links): the sweep is the
# best MPI transport here, the limit the engines are held to. The raw baselines keep
# Open MPI's defaults (one connection), as a user who writes them gets.
COMM_MPI_ARGS = ["--mca", "mpi_yield_when_idle", "1", "--mca", "btl_tcp_links", "2"]


def plan(quick: bool) -> dict:
    if quick:
        return {
            "links": ["1gbit", "none"],
            "contenders": ["hpctrain_mpi", "ddp_gloo"],
            "warmup": 3,
            "iters": 3,
            "batches": 4,
        }
    links = (
        os.environ.get("HPCTRAIN_BENCH_LINKS", "").split(",")
        if os.environ.get("HPCTRAIN_BENCH_LINKS")
        else LINKS
    )  # e.g. HPCTRAIN_BENCH_LINKS=1gbit,10gbit for a shorter run
    return {"links": links, "contenders": list(CONTENDERS), "warmup": 5, "iters": 5, "batches": 6}


def _measure(ctx, cluster, kind, link, p, extra=()) -> dict:
    """One contender on one link: per-iteration step seconds (2 nodes x 1 rank)."""
    name = f"network-{kind}-{link}"
    work = ctx.scratch(name)
    for old in ("metrics.jsonl", "out.json"):
        (work / old).unlink(missing_ok=True)
    if kind.startswith("hpctrain"):
        engine = kind.split("_", 1)[1]
        args = scaling.hpctrain_args(
            "torch",
            MODEL,
            2,
            p["warmup"],
            p["iters"],
            p["batches"],
            work,
            extra=[f"train.allreduce={engine}", *extra],
        )
    else:
        script_kind = "mpi4py" if kind == "compute" else kind
        args = scaling.baseline_args(
            script_kind, "torch", MODEL, p["warmup"], p["iters"], p["batches"], work / "out.json"
        ) + list(extra)
    steps = p["warmup"] + p["iters"] * p["batches"]
    job = common.mpirun(ctx, 2, args, timeout=150 + 2.0 * steps, mpi_args=_mpi(cluster))
    if kind.startswith("hpctrain"):
        rates = scaling.hpctrain_iterations(work, p["warmup"], p["batches"])
    else:
        rates = (common.read_json(work / "out.json") or {}).get("img_secs", [])
    seconds = [BATCH / r for r in rates if r]
    return {
        "contender": kind,
        "link": link,
        "step": common.mean_conf(seconds),
        "ok": job.ok and bool(seconds),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def _mpi(cluster) -> list[str]:
    """mpirun arguments placing one rank on each node (mpirun itself stays outside)."""
    from hpctrain.cluster import mpirun_args

    return mpirun_args(cluster.plan, cluster.agent, per_node=1)


def _comm(ctx, cluster, link, grad_bytes: int) -> dict:
    """MPI_Allreduce sweep up to the gradient size over `link`: comm time and α–β points."""
    out = ctx.scratch(f"network-allreduce-{link}") / "a.json"
    out.unlink(missing_ok=True)
    args = [
        common.PYTHON,
        "benchmarks/workers/allreduce.py",
        "--lib",
        "mpi",
        "--max-bytes",
        str(grad_bytes),
        "--json",
        str(out),
    ]
    if ctx.quick:
        args.append("--quick")
    job = common.mpirun(ctx, 2, args, timeout=240, mpi_args=_mpi(cluster) + COMM_MPI_ARGS)
    rows = (common.read_json(out) or {}).get("rows", []) if job.ok else []
    points = [(2, r["bytes"], r["seconds"]) for r in rows]
    fit = None
    if len(points) >= 2:
        a, b = ab.fit_alpha_beta(points)
        errors = [ab.ring_allreduce_time(n, s, a, b) / t - 1 for n, s, t in points]
        fit = {
            "alpha": a,
            "beta": b,
            "gbit_per_s": (8 / b / 1e9) if b else None,
            "median_abs_rel_error": sorted(abs(e) for e in errors)[len(errors) // 2],
            "error_at_gradient_size": errors[-1],
        }
    full = next((r for r in rows if r["bytes"] == grad_bytes - grad_bytes % 4), None)
    return {
        "link": link,
        "ok": job.ok and full is not None,
        "seconds": full["seconds"] if full else None,
        "rows": rows,
        "fit": fit,
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def run(ctx) -> dict:
    from hpctrain.cluster import ClusterUnavailable, session

    p = plan(ctx.quick)
    tensors = gradient_tensors(WORKLOADS[MODEL])
    grad_bytes = int(sum(tensors))
    links = []
    try:
        with session(nodes=2, wait=300, what="make bench (network section)") as cluster:
            for link in p["links"]:
                cluster.shape(link)
                # Compute alone is measured again beside each link's runs, so that the
                # step and its two parts share the same moment of a shared machine.
                compute = _measure(ctx, cluster, "compute", link, p, extra=["--no-allreduce"])
                comm = _comm(ctx, cluster, link, grad_bytes)
                rows = [_measure(ctx, cluster, kind, link, p) for kind in p["contenders"]]
                links.append({"link": link, "compute": compute, "comm": comm, "rows": rows})
    except ClusterUnavailable as exc:
        return {"skipped": str(exc), "plan": p}
    _derive(links, tensors)
    return {
        "plan": p,
        "workload": WORKLOADS[MODEL].describe(),
        "grad_bytes": grad_bytes,
        "tensors": len(tensors),
        "links": links,
    }


def _derive(links, tensors) -> None:
    """max(compute, comm), overlap ratio, and the α–β projection's error, per row."""
    for entry in links:
        c = entry["compute"]["step"]["mean"]
        w = ab.Workload(MODEL, c or 0.0, list(tensors))
        comm, fit = entry["comm"]["seconds"], entry["comm"]["fit"]
        for r in entry["rows"]:
            step = r["step"]["mean"]
            r["bound"] = max(c, comm) if c and comm else None
            r["step_over_bound"] = step / r["bound"] if step and r["bound"] else None
            r["overlap"] = (c + comm - step) / min(c, comm) if step and c and comm else None
            r["projection"] = None
            if fit and c and step:
                sync = ab.step_time(w, 2, fit["alpha"], fit["beta"], fusion=True, overlap=False)
                hidden = ab.step_time(w, 2, fit["alpha"], fit["beta"], fusion=True, overlap=True)
                r["projection"] = {
                    "no_overlap": sync,
                    "overlap": hidden,
                    "error_no_overlap": sync / step - 1,
                    "error_overlap": hidden / step - 1,
                }


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v * 100:+.0f}%"


def markdown(data, ctx) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}."
    out = [
        f"2 nodes x 1 rank (network namespaces on this machine, `hpctrain cluster`), torch, "
        f"one compute thread per rank, {data['workload']}: {data['grad_bytes'] / 1e6:.2f} MB "
        f"of gradients in {data['tensors']} tensors. Step = per-iteration mean ± 1.96·std "
        "(ms). Compute = the same step with no communication on both nodes at once "
        "(mpi4py loop without its Allreduce), measured beside each link's runs (± its "
        "1.96·std). Comm = MPI_Allreduce of the gradient bytes alone over the link (median). "
        "Overlap = (compute + comm − step) / min(compute, comm). The α–β projection "
        "is compute + T(2, S) without overlap, and with the allreduce hidden behind up to "
        "2/3 of the compute (the bound `benchmarks/alphabeta.py` uses); its error is "
        "projected / measured − 1.",
        "",
        "| link | contender | step (ms) | compute (ms) | comm (ms) | max(compute, comm) "
        "| step / max | overlap | α–β error (no overlap / overlap) | other load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for entry in data["links"]:
        comm, c = entry["comm"]["seconds"], entry["compute"]["step"]
        for r in entry["rows"]:
            pj = r["projection"] or {}
            status = "" if r["ok"] else " **FAILED**"
            load = "" if r["foreign_load"] is None else f"{r['foreign_load']:.2f}"
            ratio = "n/a" if r["step_over_bound"] is None else f"{r['step_over_bound']:.2f}"
            overlap = "n/a" if r["overlap"] is None else f"{r['overlap']:.2f}"
            out.append(
                f"| {LINK_LABEL.get(entry['link'], entry['link'])} "
                f"| {CONTENDERS[r['contender']]}{status} | {common.fmt_mc(r['step'], 1, 1e3)} "
                f"| {common.fmt_mc(c, 1, 1e3)} | {_ms(comm)} | {_ms(r['bound'])} | {ratio} "
                f"| {overlap} | {_pct(pj.get('error_no_overlap'))} / "
                f"{_pct(pj.get('error_overlap'))} | {load} |"
            )
    out += [
        "",
        "**α–β per link** (fitted to the MPI_Allreduce sweep, np=2, 8 B up to the "
        "gradient size; the ring's 2(n−1)/n·S is S at n=2):",
        "",
        "| link | α (µs) | 1/β (Gbit/s) | comm at S (ms) | fit error at S | median fit error "
        "| other load |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in data["links"]:
        f, cm = entry["comm"]["fit"], entry["comm"]
        load = "" if cm["foreign_load"] is None else f"{cm['foreign_load']:.2f}"
        if not f:
            out.append(
                f"| {LINK_LABEL.get(entry['link'])} | n/a | n/a | n/a | n/a | n/a | {load} |"
            )
            continue
        out.append(
            f"| {LINK_LABEL.get(entry['link'], entry['link'])} | {f['alpha'] * 1e6:.0f} "
            f"| {f['gbit_per_s']:.2f} | {_ms(cm['seconds'])} "
            f"| {_pct(f['error_at_gradient_size'])} | {f['median_abs_rel_error'] * 100:.0f}% "
            f"| {load} |"
        )
    errs = [
        abs(r["projection"][k])
        for e in data["links"]
        for r in e["rows"]
        if r["projection"]
        for k in ("error_no_overlap",)
    ]
    if errs:
        out += [
            "",
            f"Over all {len(errs)} measured steps the no-overlap projection's |error| is "
            f"median {sorted(errs)[len(errs) // 2] * 100:.0f}%, max {max(errs) * 100:.0f}%.",
        ]
    return "\n".join(out)


def plots(data, ctx) -> list[str]:
    if "skipped" in data or not data["links"]:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [e["link"] for e in data["links"]]
    xs = list(range(len(links)))
    compute = [e["compute"]["step"]["mean"] for e in data["links"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, label in CONTENDERS.items():
        ys = [
            next((r["step"]["mean"] for r in e["rows"] if r["contender"] == kind), None)
            for e in data["links"]
        ]
        if any(y is not None for y in ys):
            ax.plot(xs, [None if y is None else y * 1e3 for y in ys], marker="o", label=label)
        ov = [
            next((r["overlap"] for r in e["rows"] if r["contender"] == kind), None)
            for e in data["links"]
        ]
        if any(v is not None for v in ov):
            ax2.plot(xs, ov, marker="o", label=label)
    comm = [e["comm"]["seconds"] for e in data["links"]]
    ax.plot(xs, [None if v is None else v * 1e3 for v in comm], "k--", label="comm alone")
    ax.plot(xs, [None if v is None else v * 1e3 for v in compute], "k:", label="compute alone")
    for a in (ax, ax2):
        a.set_xticks(xs)
        a.set_xticklabels([LINK_LABEL.get(x, x) for x in links])
        a.grid(True, alpha=0.3)
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.set_title(f"Step time, 2 nodes x 1 rank, {MODEL} ({data['grad_bytes'] / 1e6:.1f} MB)")
    ax.legend(fontsize=7)
    ax2.axhline(0, color="gray", lw=1)
    ax2.axhline(1, color="gray", lw=1, ls=":")
    ax2.set_ylabel("overlap ratio")
    ax2.set_title("(compute + comm − step) / min(compute, comm)")
    fig.tight_layout()
    name = "network_steps.png"
    fig.savefig(ctx.out / name, dpi=110)
    plt.close(fig)
    return [name]
