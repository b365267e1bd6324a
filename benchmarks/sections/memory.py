"""Memory per rank and step time with ZeRO-1/2, beside plain data parallelism.

One node, torch and TensorFlow, Adam (2 float32 slots: K=8 bytes per parameter in
float32 training), the mlp workload (1.3 M parameters, 5.3 MB of float32 gradients).
np=2 for step time (one rank per core); np=4 oversubscribed for memory only. Measured
per rank, from metrics.jsonl: parameter, gradient (peak held during the step) and
optimizer-state bytes, and the process's peak RSS; beside the ZeRO paper's model for
float32 training: parameters 4 Psi, optimizer state 8 Psi / N, gradients 4 Psi (stage 1)
or 4 Psi / N plus what backward holds (stage 2).

Then `train.precision: bf16` against float32, np=2, mlp and cnn, both backends: step
time only (this CPU has AVX512-BF16; bf16 may still be slower, and is reported as is).
"""

from __future__ import annotations

import json

from .. import common
from ..workloads import BATCH
from . import scaling

TITLE = "Memory per rank: ZeRO-1/2 vs plain data parallelism; bf16 step time"
MODEL = "mlp"
STAGES = {0: "plain data parallel", 1: "ZeRO-1", 2: "ZeRO-2"}
MEM_KEYS = (
    "mem_param_bytes",
    "mem_grad_bytes",
    "mem_optimizer_bytes",
    "mem_peak_rss_bytes",
    "zero_model_grad_bytes",
    "zero_model_optimizer_bytes",
)


def plan(quick: bool) -> dict:
    return {
        "backends": ["torch"] if quick else ["torch", "tensorflow"],
        "sizes": [2] if quick else [2, 4],
        "warmup": 3 if quick else 5,
        "iters": 3 if quick else 5,
        "batches": 4 if quick else 6,
        "precision_models": ["mlp"] if quick else ["mlp", "cnn"],
    }


def _row(ctx, backend, np_, stage, p, model=MODEL, precision=None) -> dict:
    """One run; `precision` given: a row of the bf16-vs-float32 table (own folder)."""
    tag = f"precision-{precision}" if precision else f"zero{stage}"
    work = ctx.scratch(f"memory-{backend}-{model}-np{np_}-{tag}")
    precision = precision or "fp32"
    (work / "metrics.jsonl").unlink(missing_ok=True)
    extra = ["optimizer.name=adam", "train.allreduce=mpi", f"train.zero={stage}"]
    extra.append(f"train.precision={precision}")
    args = scaling.hpctrain_args(
        backend, model, np_, p["warmup"], p["iters"], p["batches"], work, extra=extra
    )
    steps = p["warmup"] + p["iters"] * p["batches"]
    job = common.mpirun(ctx, np_, args, timeout=150 + 2.0 * steps)
    rates = scaling.hpctrain_iterations(work, p["warmup"], p["batches"])
    last = {}
    try:
        records = [json.loads(s) for s in (work / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if r.get("event") == "step"][-1]
    except (OSError, IndexError, ValueError):
        pass
    seconds = [BATCH / r for r in rates if r]
    return {
        "backend": backend,
        "model": model,
        "precision": precision,
        "np": np_,
        "stage": stage,
        "step": common.mean_conf(seconds) if np_ <= ctx.cores else None,
        "memory": {k: last.get(k) for k in MEM_KEYS},
        "ok": job.ok and bool(last),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def run(ctx) -> dict:
    p = plan(ctx.quick)
    rows = [
        _row(ctx, backend, np_, stage, p)
        for backend in p["backends"]
        for np_ in p["sizes"]
        for stage in STAGES
    ]
    precision = [
        _row(ctx, backend, 2, 0, p, model=model, precision=prec)
        for backend in p["backends"]
        for model in p["precision_models"]
        for prec in ("fp32", "bf16")
    ]
    return {"plan": p, "rows": rows, "precision": precision}


def _mb(value) -> str:
    return f"{value / 2**20:.2f}" if value else ""


def markdown(data, ctx) -> str:
    out = [
        "One node, Adam, mlp (5.3 MB of float32 parameters). Bytes per rank (MB), "
        "measured; (model) = the ZeRO formula for float32 training. Step time only where "
        "ranks <= cores; vs plain = plain step / this step.\n",
        "| backend | np | method | step (ms) | vs plain | params | grads held | grads "
        "(model) | optimizer | optimizer (model) | peak RSS |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = {
        (r["backend"], r["np"]): r["step"]["mean"]
        for r in data["rows"]
        if r["stage"] == 0 and r.get("ok") and r.get("step")
    }
    for r in data["rows"]:
        m = r["memory"]
        step = r["step"]["mean"] if r.get("ok") and r.get("step") else None
        base = plain.get((r["backend"], r["np"]))
        vs = f"{base / step:.2f}x" if step and base else ""
        shown = f"{step * 1e3:.1f}" if step else ("failed" if not r.get("ok") else "")
        grads_model = m.get("zero_model_grad_bytes") if r["stage"] else m.get("mem_param_bytes")
        opt_model = (
            m.get("zero_model_optimizer_bytes")
            if r["stage"]
            else (2 * m["mem_param_bytes"] if m.get("mem_param_bytes") else None)
        )
        out.append(
            f"| {r['backend']} | {r['np']} | {STAGES[r['stage']]} | {shown} | {vs} | "
            f"{_mb(m.get('mem_param_bytes'))} | {_mb(m.get('mem_grad_bytes'))} | "
            f"{_mb(grads_model)} | {_mb(m.get('mem_optimizer_bytes'))} | {_mb(opt_model)} | "
            f"{_mb(m.get('mem_peak_rss_bytes'))} |"
        )
    out.append(
        "\nPlain data parallelism's gradients held include the MPI engine's flat buffer "
        "(2 x 4 Psi). TensorFlow's tape returns every gradient at once, so its ZeRO-2 "
        "holds the whole gradient during backward; torch's frees each one as it is copied "
        "into its segment."
    )
    rows = data.get("precision", [])
    if rows:
        out += [
            "",
            "**bf16 vs float32** (np=2, one node, Adam; step = per-iteration mean):",
            "",
            "| backend | model | fp32 step (ms) | bf16 step (ms) | bf16 throughput vs fp32 |",
            "|---|---|---:|---:|---:|",
        ]
        by = {(r["backend"], r["model"], r["precision"]): r for r in rows}
        for backend, model in dict.fromkeys((r["backend"], r["model"]) for r in rows):
            a, b = by.get((backend, model, "fp32")), by.get((backend, model, "bf16"))
            ma = a["step"]["mean"] if a and a.get("ok") and a.get("step") else None
            mb = b["step"]["mean"] if b and b.get("ok") and b.get("step") else None
            ratio = f"{ma / mb:.2f}x" if ma and mb else ""
            show = [f"{m * 1e3:.1f}" if m else "failed" for m in (ma, mb)]
            out.append(f"| {backend} | {model} | {show[0]} | {show[1]} | {ratio} |")
    return "\n".join(out) + "\n"
