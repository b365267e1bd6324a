"""GPU ranks (only where torch sees a CUDA GPU; the report names the device).

hpctrain on one GPU against a hand-written torch loop and torch DDP over NCCL at np=1,
same transformer (>= 100 M parameters), batch and bf16 precision: tokens/s, MFU, the
step's split, the data path's rate against the step's, and the host-staged MPI
engine's cost per MB. The measuring is benchmarks/gpu_bench.py's (also run alone by
tools/gpu_check.sh on the GPU machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TITLE = "GPU ranks: hpctrain vs a plain torch loop and DDP (NCCL), one GPU"
BENCH = Path(__file__).resolve().parents[1] / "gpu_bench.py"


def _cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def run(ctx) -> dict:
    if not _cuda():
        return {"skipped": "no CUDA GPU visible to torch on this machine"}
    out = ctx.scratch("gpu")
    steps = "10" if ctx.quick else "30"
    job = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(out), "--steps", steps],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if job.returncode != 0:
        return {"error": (job.stdout + job.stderr)[-3000:]}
    return json.loads((out / "gpu_bench.json").read_text())


def markdown(data, ctx) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}."
    if "error" in data:
        return "Failed:\n\n```\n" + data["error"] + "\n```"
    lines = [
        f"Device: **{data['device']}**, torch {data['torch']}.",
        "",
        "| model | params | plain tok/s | DDP tok/s | hpctrain tok/s | hpctrain/plain | "
        "MFU (hpctrain) | data/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, r in data["sections"].items():
        h, tok = r["hpctrain"], r["tokens_per_step"]
        lines.append(
            f"| transformer-{size} | {r['params'] / 1e6:.0f} M | {tok / r['plain_step_s']:,.0f} | "
            f"{tok / r['ddp_step_s']:,.0f} | {h.get('tokens_per_s', float('nan')):,.0f} | "
            f"{h.get('vs_plain', float('nan')):.3f} | {h.get('mfu', float('nan')):.1%} | "
            f"{r.get('data_path', {}).get('ratio', float('nan')):.1f}x |"
        )
    s = data["staging"]
    lines.append("")
    lines.append(f"Host-staged MPI engine: {s['round_trip_ms_per_mb']:.3f} ms per MB of gradients.")
    return "\n".join(lines)
