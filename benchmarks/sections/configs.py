"""The worked configurations, each trained to its end with its own launch line.

Why: `configs/*.yaml` are what a new user runs first, and each states what it reaches.
This section runs every CPU one exactly as its header's `mpirun -np N hpctrain ...`
line says (a fresh run directory added, nothing else changed) and reports its final
validation accuracy beside the best any model can reach on its data (the synthetic
file's `bayes_accuracy`) or chance, its epochs and its wall time, so that the figures
the files quote come from a committed report. `configs/gpu.yaml` needs GPU nodes and is
left to the gpu section. In --quick, only the demo runs.
"""

from __future__ import annotations

import json
import re
import shlex

from .. import common

TITLE = "The worked configurations, trained to their end"
CONFIGS = ["demo", "demo-tf", "pipeline", "ps", "moe", "transformer-tp-zero"]
TIMEOUT = 900  # seconds a configuration may take (the slowest took ~5 minutes here)
LAUNCH = re.compile(r"^#\s*(mpirun -np (\d+) hpctrain (\w+) --config (configs/\S+\.yaml))")


def launch_line(name: str) -> tuple[str, int, str]:
    """(the header's launch line, its ranks, its hpctrain subcommand)."""
    path = common.ROOT / "configs" / f"{name}.yaml"
    for line in path.read_text().splitlines():
        found = LAUNCH.match(line)
        if found:
            return found.group(1), int(found.group(2)), found.group(3)
    raise ValueError(f"{path}: no `# mpirun -np N hpctrain ... --config ...` line")


def _records(run_dir) -> list[dict]:
    try:
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _best_possible(output: str) -> float | None:
    """The data file's bayes_accuracy (synthetic tasks with known label noise)."""
    found = re.search(r"data (\S+): \d+ train", output)
    if not found:
        return None
    import h5py

    try:
        with h5py.File(found.group(1), "r") as f:
            value = f.attrs.get("bayes_accuracy")
    except OSError:
        return None
    return None if value is None else float(value)


def run_config(ctx, name: str) -> dict:
    line, ranks, sub = launch_line(name)
    work = ctx.scratch(f"config-{name}")
    args = [common.HPCTRAIN, sub, "--config", f"configs/{name}.yaml"]
    args += ["--run-dir", str(work / "run"), "--overwrite"]
    job = common.mpirun(ctx, ranks, args, TIMEOUT)
    records = _records(work / "run")
    summary = next((r for r in records if r.get("event") == "summary"), {})
    epochs = [r for r in records if r.get("event") == "epoch"]
    classes = re.search(r", (\d+) classes", job.output)
    return {
        "config": f"configs/{name}.yaml",
        "launch": line,
        "ranks": ranks,
        "status": "ok" if job.ok and summary else f"failed (rc {job.returncode})",
        "seconds": round(job.seconds, 1),
        "other_load_cores": job.record()["foreign_load_cores"],
        "epochs": (epochs[-1]["epoch"] + 1) if epochs else summary.get("epoch"),
        "val_accuracy": summary.get("val_accuracy"),
        "best_possible": _best_possible(job.output),
        "chance": 1.0 / int(classes.group(1)) if classes else None,
        "log_tail": "" if job.ok else "\n".join(job.output.splitlines()[-20:]),
    }


def run(ctx) -> dict:
    names = ["demo"] if ctx.quick else CONFIGS
    return {"configs": [run_config(ctx, name) for name in names]}


def _acc(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def markdown(data, ctx) -> str:
    out = [
        "Each CPU configuration under `configs/` run exactly as its header's launch line "
        "says (plus `--run-dir` and `--overwrite`), to its last epoch. *Best possible*: "
        "the synthetic data's `bayes_accuracy`, the accuracy of its true labelling "
        "function under the label noise.",
        "",
        "| config | launch | status | epochs | val accuracy | best possible | chance "
        "| wall s | other load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["configs"]:
        load = r["other_load_cores"]
        out.append(
            f"| `{r['config']}` | `{shlex.join(r['launch'].split())}` | {r['status']} "
            f"| {r['epochs'] if r['epochs'] is not None else '-'} | {_acc(r['val_accuracy'])} "
            f"| {_acc(r['best_possible'])} | {_acc(r['chance'])} | {r['seconds']:.0f} "
            f"| {'-' if load is None else f'{load:.2f}'} |"
        )
    out.append("")
    for r in data["configs"]:
        if r["log_tail"]:
            out += [f"`{r['config']}` failed:", "", "```", r["log_tail"], "```", ""]
    return "\n".join(out)
