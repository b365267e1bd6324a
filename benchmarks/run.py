"""`make bench`: scaling numbers side by side with the baselines that matter.

    .venv/bin/python benchmarks/run.py [--quick] [--out DIR] [--network 25GbE-RoCE]
                                       [--alpha SECONDS --beta SECONDS_PER_BYTE]
                                       [--sections scaling,allreduce,...]

Runs each section in SECTIONS (a module in benchmarks/sections/ with TITLE, run(ctx),
markdown(data, ctx) and optionally plots(data, ctx)) in order; later sections read
earlier ones' data from ctx.results. Every measurement is an mpirun subprocess under a
hard timeout. Writes benchmarks/results/<UTC timestamp>/ (results.json, report.md,
PNGs) and points benchmarks/latest at it. Exits 1 if a section or a job failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import alphabeta, common  # noqa: E402

# Add a section by writing benchmarks/sections/<name>.py and listing it here.
SECTIONS = [
    "scaling",
    "ablation",
    "allreduce",
    "projection",
    "strategies",
    "network",
    "exchange",
    "convergence",
    "memory",
    "zero",
    "configs",
    "gpu",  # only where torch sees a CUDA GPU (skipped with the reason elsewhere)
]
BUDGET_SECONDS = {True: 100, False: 13 * 60}  # quick / full, before optional work is cut


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: fewer models/sizes/iters")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<UTC>)")
    p.add_argument(
        "--network",
        choices=sorted(alphabeta.NETWORKS),
        default=None,
        help="named network for the projection (default 25GbE-RoCE)",
    )
    p.add_argument("--alpha", type=float, help="projection latency α, seconds per ring step")
    p.add_argument("--beta", type=float, help="projection inverse bandwidth β, seconds/byte")
    p.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument(
        "--render-only", type=Path, metavar="DIR", help="re-render DIR's report, measure nothing"
    )
    return p.parse_args(argv)


def headline(ctx) -> list[str]:
    """The few numbers a reader wants first, from whatever sections ran."""
    lines = []
    sc = ctx.results.get("scaling")
    if sc:
        from benchmarks.sections import scaling

        for backend in sc["plan"]["backends"]:
            r = scaling.find(sc["rows"], "hpctrain", backend, "cnn", 2)
            if r:
                lines.append(
                    f"- hpctrain {backend} cnn, np=2: {common.fmt_mc(r['total'], 0)} img/s total, "
                    f"weak-scaling efficiency **{common.fmt_pct(r['efficiency'])}** (target ≥ 90%), "
                    f"hpctrain/raw Horovod **{common.fmt_ratio(r.get('vs_raw_horovod'))}**, "
                    f"hpctrain/mpi4py **{common.fmt_ratio(r.get('vs_mpi4py'))}**"
                )
    ab_ = ctx.results.get("ablation")
    if ab_ and "rows" in ab_:
        top = next((r for r in ab_["rows"] if r["label"].startswith("independent")), None)
        for r in ab_["rows"]:
            if r["label"] == "hpctrain defaults":
                n = ab_["repeats"]
                ceiling = ""
                if r.get("vs_ceiling") and top:
                    ceiling = (
                        f", {common.fmt_pct(r['vs_ceiling'])} of two non-communicating "
                        "processes, whose own efficiency (this machine's np=2 ceiling) is "
                        f"{common.fmt_pct(top['efficiency'])}"
                    )
                lines.append(
                    f"- ablation, hpctrain defaults at np=2 ({n} interleaved run"
                    f"{'s' if n > 1 else ''}): efficiency {common.fmt_pct(r['efficiency'])}"
                    + ceiling
                )
    ar = ctx.results.get("allreduce")
    if ar:
        wrong = sum(r["wrong"] for res in ar["results"] for r in res["rows"])
        lines.append(f"- allreduce microbenchmark: #wrong = {wrong} over all sizes and paths")
    zr = ctx.results.get("zero")
    if zr and "rows" in zr:
        from benchmarks.sections import zero

        lines += zero.headline(zr)
    pj = ctx.results.get("projection")
    if pj and pj.get("local_fit"):
        lines.append(
            "- α–β fit on this machine: "
            + alphabeta.describe(pj["local_fit"]["alpha"], pj["local_fit"]["beta"])
        )
    return lines


def write_outputs(ctx, record, reports) -> None:
    record["jobs"] = ctx.jobs
    record.setdefault("finished_utc", None)
    if ctx.deadline:  # a measuring run (not --render-only)
        record["finished_utc"] = datetime.now(timezone.utc).isoformat()
    (ctx.out / "results.json").write_text(json.dumps(record, indent=1, default=str))
    m = record["machine"]
    head = [
        f"# hpctrain benchmarks ({'quick' if ctx.quick else 'full'}), {record['started_utc']}",
        "",
        f"Machine: {m['cores']} cores ({m['cpu_model']}), {m['ram_gib']} GiB RAM, "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}. "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v),
        "",
        "Every command with its time and the other load on the machine is in "
        "`results.json` (`jobs`).",
        "",
    ]
    lines = headline(ctx)
    if lines:  # a run of sections with no headline figures (--sections configs) has none
        head += ["## Headline", "", *lines, ""]
    (ctx.out / "report.md").write_text("\n".join(head + reports) + "\n")


def render_section(mod, data, ctx) -> str:
    """The section's markdown and plots; a failure here is reported, not raised."""
    if "error" in data:
        return f"```\n{data['error']}\n```"
    try:
        body = mod.markdown(data, ctx)
        if hasattr(mod, "plots"):
            body += "\n\n" + "\n".join(f"![{p}]({p})" for p in mod.plots(data, ctx))
        return body
    except Exception:  # noqa: BLE001
        return f"Rendering failed:\n```\n{traceback.format_exc()}\n```"


def render_only(folder: Path) -> int:
    """Rebuild report.md and the PNGs of an earlier run from its results.json."""
    record = json.loads((folder / "results.json").read_text())
    ctx = common.Context(out=folder, quick=record["quick"], cores=0, deadline=0.0)
    ctx.jobs = record.get("jobs", [])
    reports = []
    for name, sec in record["sections"].items():
        mod = importlib.import_module(f"benchmarks.sections.{name}")
        ctx.results[name] = sec["data"]
        reports += [f"## {mod.TITLE}", "", render_section(mod, sec["data"], ctx), ""]
    write_outputs(ctx, record, reports)
    print(f"[bench] re-rendered {folder / 'report.md'}")
    return 0


def update_latest(out: Path) -> None:
    link = common.BENCH / "latest"
    try:
        target = os.path.relpath(out.resolve(), link.parent)
        tmp = link.with_name("latest.tmp")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(target)
        os.replace(tmp, link)
    except OSError as exc:
        print(f"[bench] could not update {link}: {exc}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        return render_only(args.render_only)
    started = datetime.now(timezone.utc)
    out = args.out or common.BENCH / "results" / started.strftime("%Y%m%dT%H%M%SZ")
    if args.out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        # results.json, report.md and the PNGs would land among (or over) what is there
        print(f"[bench] error: --out {out} exists and is not an empty folder: name a new one")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    ctx = common.Context(
        out=out,
        quick=args.quick,
        cores=len(os.sched_getaffinity(0)),
        deadline=time.monotonic() + BUDGET_SECONDS[args.quick],
        alpha=args.alpha,
        beta=args.beta,
        network=args.network,
    )
    names = args.sections.split(",") if args.sections else SECTIONS
    record = {
        "started_utc": started.isoformat(),
        "argv": sys.argv,
        "quick": args.quick,
        "machine": common.machine_info(),
        "versions": common.versions(),
        "sections": {},
    }
    print(f"[bench] writing {out}", flush=True)
    reports, failed = [], []
    for name in names:
        mod = importlib.import_module(f"benchmarks.sections.{name}")
        t0 = time.monotonic()
        print(f"[bench] === {mod.TITLE}", flush=True)
        try:
            data = mod.run(ctx)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others
            data = {"error": traceback.format_exc()}
            print(data["error"], flush=True)
        ctx.results[name] = data
        record["sections"][name] = {"seconds": time.monotonic() - t0, "data": data}
        body = render_section(mod, data, ctx)
        if "error" in data:
            failed.append(name)
        reports += [f"## {mod.TITLE}", "", body, ""]
        write_outputs(ctx, record, reports)
    bad_jobs = [j for j in ctx.jobs if j.get("returncode") not in (0, None)]
    write_outputs(ctx, record, reports)
    update_latest(out)
    print(f"[bench] report: {out / 'report.md'}")
    print("\n".join(headline(ctx)))
    if failed or bad_jobs:
        print(f"[bench] FAILED sections {failed}, {len(bad_jobs)} failed job(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
