"""Slot for the other features' own benchmarks (checkpoint, parameter server, ...).

Why: each feature's engineer owns a `benchmarks/bench_<feature>.py` that writes its
figures with `--json OUT`; `make bench` should report them next to the scaling numbers
without knowing their insides. Each script that exists runs with the arguments listed
in SCRIPTS (smaller ones in a quick run, where the long ones are skipped to keep
`make bench-quick` under two minutes), its JSON is kept verbatim in results.json, and
the report renders it generically: lists of records as tables, other values as
key: value lines. Add a feature by adding a line to SCRIPTS.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from .. import common

TITLE = "Strategy benchmarks"
# name, script, arguments and timeout (s) of the full run, of the quick run (None: not
# in a quick run). A missing script is reported as absent.
SCRIPTS = [
    (
        "checkpoint",
        "bench_checkpoint.py",
        ["--repeat", "7"],
        300,
        ["--quick"],
        60,
    ),
    ("parameter server", "bench_ps.py", [], 300, None, 0),
    ("pipeline", "bench_pipeline.py", [], 240, None, 0),
    ("mixture of experts", "bench_moe.py", [], 240, ["--quick"], 60),
]


def run_script(ctx, name, script, full_args, full_timeout, quick_args, quick_timeout) -> dict:
    path = common.BENCH / script
    if not path.exists():
        return {"name": name, "script": script, "status": "absent"}
    if ctx.quick and quick_args is None:
        return {"name": name, "script": script, "status": "skipped in --quick (too long)"}
    if not ctx.quick and ctx.time_left() < full_timeout / 2:
        return {"name": name, "script": script, "status": "skipped: time budget spent"}
    out = ctx.scratch("strategy-" + script.removesuffix(".py")) / "out.json"
    args = [common.PYTHON, str(path), *(quick_args if ctx.quick else full_args)]
    args += ["--json", str(out)]
    timeout = quick_timeout if ctx.quick else full_timeout
    env = {**os.environ, **common.MPI_ENV, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=common.ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        code = 124
    seconds = time.monotonic() - t0
    command = " ".join(args)
    ctx.jobs.append({"command": command, "returncode": code, "seconds": round(seconds, 1)})
    print(f"[bench] {seconds:6.1f} s rc={code}: {command}", flush=True)
    data = common.read_json(out)
    return {
        "name": name,
        "script": script,
        "status": "ok" if code == 0 and data is not None else f"failed (rc {code})",
        "seconds": seconds,
        "command": command,
        "data": data,
        "log_tail": "\n".join(log.splitlines()[-20:]) if code else "",
        "pngs": sorted(str(p.relative_to(ctx.out)) for p in out.parent.glob("*.png")),
    }


def run(ctx) -> dict:
    return {"scripts": [run_script(ctx, *entry) for entry in SCRIPTS]}


# --- generic rendering of someone else's JSON -------------------------------------------
def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v)


def _table(records: list[dict]) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if k not in keys and not _nested(v):
                keys.append(k)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in records:
        lines.append("| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |")
    return lines


def _records(value) -> list[dict] | None:
    """A list of records, or a mapping name -> record, as rows for one table."""
    if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
        return value
    rows = value.values() if isinstance(value, dict) else ()
    if rows and all(isinstance(r, dict) and not any(map(_nested, r.values())) for r in rows):
        return [{"name": k, **r} for k, r in value.items()]
    return None


def _nested(v) -> bool:
    """Needs its own heading: a mapping, or a list holding mappings."""
    return isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v))


def render(value, title: str = "", depth: int = 0) -> list[str]:
    """Records become tables, other mappings nest under italic headings, the rest k: v."""
    lines: list[str] = [f"*{title}*", ""] if title and depth > 0 else []
    records = _records(value)
    if records is not None:
        return lines + _table(records) + [""]
    if isinstance(value, dict):
        scalars = {k: v for k, v in value.items() if not _nested(v)}
        if scalars:
            lines += [f"- {k}: {_cell(v)}" for k, v in scalars.items()] + [""]
        for k, v in value.items():
            if not _nested(v):
                continue
            if depth >= 3:
                lines += [f"- {k}: {_cell(v)}", ""]
            else:
                lines += render(v, f"{title} / {k}" if title else k, depth + 1)
        return lines
    return lines + [f"- {_cell(value)}", ""]


def markdown(data, ctx) -> str:
    out = []
    for s in data["scripts"]:
        out.append(f"### {s['name']} (`benchmarks/{s['script']}`)")
        out.append("")
        if "command" not in s:
            out += [f"Not run: {s['status']}.", ""]
            continue
        out += [f"Status: {s['status']}, {s['seconds']:.0f} s. `{s['command']}`", ""]
        if s.get("data") is not None:
            out += render(s["data"])
        elif s.get("log_tail"):
            out += ["```", s["log_tail"], "```", ""]
        out += [f"![{s['name']}]({p})" for p in s.get("pngs", [])] + [""]
    return "\n".join(out)
