"""Allreduce microbenchmark: MPI_Allreduce (mpi4py) vs Horovod torch vs Horovod TF.

Why: it separates the transport from the training loop. MPI_Allreduce is the floor;
Horovod adds its cycle (negotiation every HOROVOD_CYCLE_TIME) and its fusion buffer
copy, which matter for small tensors and for many tensors respectively; so each Horovod
path runs with fusion on (Horovod's default threshold) and off (threshold 0), for one
tensor of S bytes and for 64 tensors of S/64 sent at once.
"""

from __future__ import annotations

from .. import common

TITLE = "Allreduce microbenchmark"
NP = 2


def jobs(quick: bool) -> list[dict]:
    max_bytes = 4 * 2**20 if quick else 256 * 2**20
    out = [{"label": "MPI_Allreduce (mpi4py)", "lib": "mpi", "env": {}, "max": max_bytes}]
    libs = [("torch", "Horovod torch")] + ([] if quick else [("tensorflow", "Horovod TF")])
    for lib, name in libs:
        out.append({"label": f"{name}, fusion on", "lib": lib, "env": {}, "max": max_bytes})
        out.append(
            {
                "label": f"{name}, fusion off",
                "lib": lib,
                "env": {"HOROVOD_FUSION_THRESHOLD": "0"},
                # unfused 64-tensor sends are latency-bound: cap sizes to keep time bounded
                "max": min(max_bytes, 64 * 2**20),
            }
        )
    return out


def run(ctx) -> dict:
    results = []
    for j in jobs(ctx.quick):
        out = ctx.scratch("allreduce-" + j["label"].replace(" ", "_").replace(",", "")) / "a.json"
        args = [
            common.PYTHON,
            "benchmarks/workers/allreduce.py",
            "--lib",
            j["lib"],
            "--max-bytes",
            str(j["max"]),
            "--json",
            str(out),
        ]
        if j["lib"] != "mpi":
            args.append("--multi")
        if ctx.quick:
            args.append("--quick")
        job = common.mpirun(ctx, NP, args, timeout=240 if ctx.quick else 420, env=j["env"])
        data = common.read_json(out) if job.ok else None
        results.append(
            {
                "label": j["label"],
                "env": j["env"],
                "ok": data is not None,
                "rows": (data or {}).get("rows", []),
                "n": NP,
                "foreign_load": job.foreign_load,
                "command": job.record()["command"],
            }
        )
    return {"np": NP, "results": results}


def mpi_points(data) -> list[tuple[int, int, float]]:
    """(n, bytes, seconds) of the MPI_Allreduce runs, for the α–β fit."""
    pts = []
    for res in data["results"]:
        if res["label"].startswith("MPI_Allreduce"):
            pts += [(res["n"], r["bytes"], r["seconds"]) for r in res["rows"] if r["tensors"] == 1]
    return pts


def _size(b: int) -> str:
    for unit, k in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


def markdown(data, ctx) -> str:
    out = [
        f"np={data['np']} on one node (shared memory). nccl-tests conventions: time is the "
        "median over iterations of the slowest rank, algbw = S/t, busbw = algbw·2(n−1)/n, "
        "#wrong counts elements that differ from the exact expected sum (float32). "
        "'x64' = 64 tensors of S/64 in flight at once (torch: 64 `allreduce_async`, "
        "TF: one `grouped_allreduce` of 64). Fusion off = HOROVOD_FUSION_THRESHOLD=0.",
        "",
    ]
    for res in data["results"]:
        load = "" if res["foreign_load"] is None else f" (other load {res['foreign_load']:.2f})"
        out.append(f"**{res['label']}**{load}{'' if res['ok'] else ' — FAILED'}")
        out.append("")
        out.append("| size | tensors | time (µs) | algbw (GB/s) | busbw (GB/s) | #wrong |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in res["rows"]:
            out.append(
                f"| {_size(r['bytes'])} | {r['tensors']} | {r['seconds'] * 1e6:.1f} "
                f"| {r['algbw'] / 1e9:.3f} | {r['busbw'] / 1e9:.3f} | {r['wrong']} |"
            )
        out.append("")
    wrong = sum(r["wrong"] for res in data["results"] for r in res["rows"])
    out.append(f"Total #wrong over every size and path: **{wrong}**.")
    return "\n".join(out)


def plots(data, ctx) -> list[str]:
    from .. import plots as P

    return P.busbw(data, ctx.out)
