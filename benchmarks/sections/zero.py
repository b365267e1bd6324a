"""ZeRO stages 0-3 side by side: model-state memory per rank and throughput.

Why: ZeRO-3 trades memory for traffic. Its parameters live as 1/N shards and each unit
of layers is gathered before its forward and again before its backward, so a step sends
1.5x the bytes of ZeRO-1/2 (see hpctrain/exchange/zero3.py); whether the prefetch hides
that behind compute is what decides its throughput. Here one transformer of ~50 M
parameters (Adam, float32) trains under every stage:

- one node, np=2 (one rank per core): memory and step time; np=4 (oversubscribed on
  2 cores): memory only;
- two emulated nodes x 1 rank over a 10 Gbit/s link (`hpctrain cluster`, needs root):
  ZeRO-2 and ZeRO-3 step time;
- the TensorFlow backend, one node: ZeRO-2 and ZeRO-3 at np=2 (step time and memory)
  and np=4 (memory). Its ZeRO-3 runs every unit but the last forward twice
  (backends/tensorflow_zero3.py): up to a third more compute than ZeRO-2's step, whose
  own cost is copying the tape's whole gradient into segments;

- one node, a deeper transformer of ~58 M parameters in 24 blocks (units of one block,
  1/24 of the model) at ZeRO-3, np 2 and 4, memory only: the model state against
  16 Psi/N + the largest unit (issue 28's "within 10%"), which the 4-block model (units
  of a quarter) cannot meet: ZeRO-3 holds a second unit for the prefetch and a unit's
  gradient beside the paper's one gathered unit.

ZeRO-3 runs twice, with `train.zero_prefetch` on and off. Memory per rank comes from
metrics.jsonl (the last step: parameters incl. the gathered units, gradients held at
the peak, optimizer state, the process's peak RSS) beside the ZeRO paper's model that
the code reports (`zero_model_*`: 4 Psi + 4 Psi + 8 Psi plain, 4 Psi + 4 Psi + 8 Psi/N
ZeRO-1, 4 Psi + 4 Psi/N + 8 Psi/N ZeRO-2, 16 Psi/N + the two largest units ZeRO-3).
Step time: the interval between consecutive step records after warm-up.
"""

from __future__ import annotations

import json

from .. import common
from ..workloads import Workload, gradient_tensors

TITLE = "ZeRO-0/1/2/3: memory per rank and throughput (transformer, Adam)"
STAGES = {0: "plain data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
ONE, TWO = "one node", "two nodes"
TF_ONE = "one node, tensorflow"  # the TensorFlow backend's rows (the rest are torch's)
FINE = "one node, small units"  # the deeper model's ZeRO-3 rows (memory only)
LINK = "10gbit"
TARGETS = {ONE: 0.85, TWO: 0.75}  # ZeRO-3 (prefetch on) throughput / ZeRO-2
MEM_KEYS = (
    "mem_param_bytes",
    "mem_grad_bytes",
    "mem_optimizer_bytes",
    "mem_peak_rss_bytes",
    "mem_rss_before_model_bytes",
    "zero_model_param_bytes",
    "zero_model_grad_bytes",
    "zero_model_optimizer_bytes",
    "zero_gathered_peak_bytes",
    "comm_bytes",
)
FULL_MODEL = {"d_model": 1024, "n_heads": 8, "d_ff": 4096, "n_layers": 4}  # 50.5 M
QUICK_MODEL = {"d_model": 256, "n_heads": 4, "d_ff": 1024, "n_layers": 4}  # 3.2 M
# 58 M parameters in 24 blocks of 9.6 MB (float32): units of 1/24 of the model
FINE_MODEL = {"d_model": 448, "n_heads": 8, "d_ff": 1792, "n_layers": 24}
STATE_TARGET = 0.10  # ZeRO-3's model state within 10% of 16 Psi/N + the largest unit


def plan(quick: bool) -> dict:
    """Stage variants are [stage, prefetch] (prefetch None below stage 3)."""
    every = [[0, None], [1, None], [2, None], [3, True], [3, False]]
    return {
        "model": QUICK_MODEL if quick else FULL_MODEL,
        "seq_len": 16,
        "vocab": 64,
        "batch": 4,  # per rank
        "unit_mb": 2.0 if quick else 16.0,  # quick: one block per unit, as in the full run
        "warmup": 2,
        "iters": 4 if quick else 8,
        "memory_steps": 3,
        "one_node": every,
        "memory_sizes": [] if quick else [4],
        "two_nodes": [[2, None], [3, True]] if quick else [[2, None], [3, True], [3, False]],
        "tensorflow": [[2, None], [3, True]],
        # ZeRO-3's model state with small units (one block each), memory only
        "fine": None if quick else {"model": FINE_MODEL, "unit_mb": 1.0, "sizes": [2, 4]},
    }


def workload(p) -> Workload:
    return Workload(
        "zero-transformer",
        "tokens",
        {"name": "transformer", **p["model"]},
        {"seq_len": p["seq_len"], "vocab": p["vocab"]},
    )


def _args(p, np_, stage, prefetch, steps, work, backend) -> list[str]:
    sets = [
        f"backend={backend}",
        "data.source=benchmark",
        f"data.train_samples={p['batch'] * np_ * steps}",
        f"train.batch_size={p['batch']}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "runtime.threads=1",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "checkpoint.enabled=false",
        "optimizer.name=adam",
        "train.allreduce=mpi",
        f"train.zero={stage}",
        f"train.zero_unit_mb={p['unit_mb']}",
        *workload(p).hpctrain_sets(),
    ]
    if prefetch is not None:
        sets.append(f"train.zero_prefetch={str(prefetch).lower()}")
    args = [common.HPCTRAIN, "train", "--run-dir", str(work)]
    for s in sets:
        args += ["--set", s]
    return args


def _steps(work) -> list[dict]:
    try:
        lines = (work / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = [json.loads(s) for s in lines if s.strip()]
    return [r for r in records if r.get("event") == "step"]


def step_seconds(steps: list[dict], warmup: int) -> list[float]:
    """Seconds per step after warm-up. Step k's record is written when step k+1 is done
    (its sums travel during the next step), the last one right after the one before it
    (drained at the end): consecutive records' times measure one step each, last excluded."""
    times = [r["time"] for r in steps if r["step"] >= warmup][:-1]
    return [b - a for a, b in zip(times, times[1:]) if b > a]


def _wait_per_step(steps: list[dict], warmup: int) -> float | None:
    """ZeRO-3: seconds per step spent waiting for gathers (a running total per rank)."""
    done = [r for r in steps if r["step"] >= warmup and "zero_gather_wait_s" in r]
    if len(done) < 2:
        return None
    a, b = done[0], done[-1]
    return (b["zero_gather_wait_s"] - a["zero_gather_wait_s"]) / (b["step"] - a["step"])


def _comm_share(steps: list[dict], warmup: int) -> float | None:
    """The mean share of a step spent blocked in communication, after warm-up."""
    shares = [r["comm_share"] for r in steps if r["step"] >= warmup and r.get("comm_share")]
    return sum(shares) / len(shares) if shares else None


def no_overlap_estimate(rows, where) -> float | None:
    """ZeRO-3 / ZeRO-2 throughput if ZeRO-3's bytes cost what ZeRO-2's cost per byte and
    none of it is hidden: ZeRO-2's step with its communication share c scaled by the
    bytes ratio, 1 / (1 - c + c x B3 / B2). Where ranks fill the cores (np=2 on 2), a
    copy that overlaps compute takes a core from it, so prefetch has little to win."""
    z2, z3 = find(rows, where, 2, 2), find(rows, where, 2, 3, True)
    if not (z2 and z3 and z2.get("comm_share")):
        return None
    b2, b3 = z2["memory"].get("comm_bytes"), z3["memory"].get("comm_bytes")
    if not (b2 and b3):
        return None
    c = z2["comm_share"]
    return 1.0 / (1.0 - c + c * b3 / b2)


def _row(ctx, p, where, np_, variant, mpi_args=None) -> dict:
    """One run of one stage: memory from its last step, step time where it is timed."""
    stage, prefetch = variant
    timed = where == TWO or (np_ <= ctx.cores and where != FINE)
    steps = p["warmup"] + p["iters"] + 1 if timed else p["memory_steps"]
    tag = {None: "", True: "-prefetch", False: "-noprefetch"}[prefetch]
    place = where.replace(" ", "").replace(",", "-")
    work = ctx.scratch(f"zero-{place}-np{np_}-zero{stage}{tag}")
    (work / "metrics.jsonl").unlink(missing_ok=True)
    timeout = 180 + 10.0 * steps * max(1.0, np_ / ctx.cores)
    backend = "tensorflow" if where == TF_ONE else "torch"
    args = _args(p, np_, stage, prefetch, steps, work, backend)
    job = common.mpirun(ctx, np_, args, timeout=timeout, mpi_args=mpi_args)
    records = _steps(work)
    last = records[-1] if records else {}
    seconds = step_seconds(records, p["warmup"]) if timed else []
    step = common.mean_conf(seconds) if timed else None
    rate = None
    if step and step["mean"]:
        rate = p["batch"] * np_ / step["mean"]
    return {
        "where": where,
        "np": np_,
        "stage": stage,
        "prefetch": prefetch,
        "step": step,
        "samples_per_s": rate,
        "gather_wait_s": _wait_per_step(records, p["warmup"]) if stage == 3 else None,
        "comm_share": _comm_share(records, p["warmup"]) if timed else None,
        "memory": {k: last.get(k) for k in MEM_KEYS},
        "ok": job.ok and bool(last) and (not timed or bool(seconds)),
        "foreign_load": job.foreign_load,
        "command": job.record()["command"],
    }


def _mpi(cluster) -> list[str]:
    """mpirun arguments placing one rank on each emulated node."""
    from hpctrain.cluster import mpirun_args

    return mpirun_args(cluster.plan, cluster.agent, per_node=1)


def _two_nodes(ctx, p) -> dict:
    from hpctrain.cluster import ClusterUnavailable, session

    try:
        with session(nodes=2, wait=300, what="make bench (zero section)") as cluster:
            cluster.shape(LINK)
            rows = [_row(ctx, p, TWO, 2, v, mpi_args=_mpi(cluster)) for v in p["two_nodes"]]
    except ClusterUnavailable as exc:
        return {"skipped": str(exc), "rows": []}
    return {"rows": rows}


def run(ctx) -> dict:
    p = plan(ctx.quick)
    w = workload(p)
    rows = [_row(ctx, p, ONE, 2, v) for v in p["one_node"]]
    rows += [
        _row(ctx, p, ONE, np_, v)
        for np_ in p["memory_sizes"]
        for v in p["one_node"]
        if v[1] is not False  # prefetch changes no memory figure
    ]
    tf_sizes = [2, *p["memory_sizes"]]  # np 2 timed, larger ones memory only
    rows += [_row(ctx, p, TF_ONE, np_, v) for np_ in tf_sizes for v in p.get("tensorflow", [])]
    two = _two_nodes(ctx, p)
    fine = p.get("fine")
    if fine:
        pf = {**p, "model": fine["model"], "unit_mb": fine["unit_mb"]}
        fine = {
            "workload": f"transformer({_opts(fine['model'])})",
            "params": sum(gradient_tensors(workload(pf))) // 4,
            "rows": [_row(ctx, pf, FINE, np_, [3, True]) for np_ in fine["sizes"]],
        }
    data = {
        "plan": p,
        "workload": f"transformer({_opts(p['model'])}) on tokens (seq_len={p['seq_len']}, "
        f"vocab={p['vocab']}), batch {p['batch']}/rank, Adam, float32",
        "params": sum(gradient_tensors(w)) // 4,
        "rows": rows + two["rows"],
        "two_nodes_skipped": two.get("skipped"),
        "fine": fine,
    }
    data["ratios"] = ratios(data["rows"])
    return data


def _opts(model: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in model.items())


def find(rows, where, np_, stage, prefetch=None) -> dict | None:
    for r in rows:
        if (r["where"], r["np"], r["stage"], r["prefetch"]) == (where, np_, stage, prefetch):
            return r
    return None


def ratios(rows) -> dict:
    """Per place: ZeRO-3 throughput / ZeRO-2's with prefetch on and off, and prefetch on
    / off (step-time ratios, so throughput ratios; mean and 1.96 sigma)."""
    out = {}
    for where in (ONE, TWO, TF_ONE):
        step = {}
        for key, stage, prefetch in (("z2", 2, None), ("on", 3, True), ("off", 3, False)):
            r = find(rows, where, 2, stage, prefetch)
            step[key] = r["step"] if r and r.get("ok") else None
        out[where] = {
            "on_vs_zero2": common.ratio(step["z2"], step["on"]),
            "off_vs_zero2": common.ratio(step["z2"], step["off"]),
            "prefetch_gain": common.ratio(step["off"], step["on"]),
        }
    return out


# --- the report ------------------------------------------------------------------------
def _mb(value) -> str:
    return f"{value / 2**20:,.1f}" if value else ""


def formula(r, psi: int) -> tuple:
    """The ZeRO model's (parameters, gradients, optimizer) bytes for this row: the code's
    zero_model_* figures, or 4/4/8 bytes per parameter without ZeRO (Adam, float32)."""
    m = r["memory"]
    if r["stage"] == 0:
        return 4 * psi, 4 * psi, 8 * psi
    return tuple(m.get(f"zero_model_{k}_bytes") for k in ("param", "grad", "optimizer"))


def method(r) -> str:
    label = STAGES[r["stage"]]
    if r["prefetch"] is not None:
        label += ", prefetch " + ("on" if r["prefetch"] else "off")
    return label


def headline(data) -> list[str]:
    """One line for the report's headline: ZeRO-3 / ZeRO-2 throughput against its targets."""
    parts = []
    for where, link in ((ONE, "one node np=2"), (TWO, "two nodes at 10 Gbit/s")):
        r = data.get("ratios", {}).get(where, {})
        if r.get("on_vs_zero2"):
            parts.append(
                f"{link} **{common.fmt_ratio(r['on_vs_zero2'])}** (target ≥ {TARGETS[where]})"
            )
    out = [f"- ZeRO-3 / ZeRO-2 throughput: {', '.join(parts)}"] if parts else []
    states = []
    for name, psi, rows in _state_models(data):
        overs = [(r["np"], state_over(r, psi)) for r in rows if _state_row(r)]
        cells = [f"np={n} {got[2]:+.1%}" for n, got in overs if got]
        if cells:
            states.append(f"{name}: {', '.join(cells)}")
    if states:
        out.append(
            f"- ZeRO-3 model state over 16 Ψ/N + the largest unit (target ≤ "
            f"{STATE_TARGET:.0%}): {'; '.join(states)}"
        )
    return out


def _num(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _memory_table(data) -> list[str]:
    psi = data["params"]
    out = [
        "| np | method | params | (formula) | grads held | (formula) | optimizer | (formula) "
        "| model state | (formula) | gathered peak | peak RSS | RSS before the model |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        if r["where"] == TWO:
            continue
        m = r["memory"]
        measured = [m.get(k) for k in ("mem_param_bytes", "mem_grad_bytes", "mem_optimizer_bytes")]
        model = formula(r, psi)
        cells = []
        for a, b in zip(measured, model):
            cells += [_mb(a), _mb(b)]
        total = sum(measured) if all(measured) else None
        total_model = sum(model) if all(model) else None
        failed = "" if r["ok"] else " **failed**"
        tf = ", tensorflow" if r["where"] == TF_ONE else ""
        out.append(
            f"| {r['np']} | {method(r)}{tf}{failed} | {' | '.join(cells)} | {_mb(total)} "
            f"| {_mb(total_model)} | {_mb(m.get('zero_gathered_peak_bytes'))} "
            f"| {_mb(m.get('mem_peak_rss_bytes'))} | {_mb(m.get('mem_rss_before_model_bytes'))} |"
        )
    return out


def state_over(r, psi: int) -> tuple[float, float, float, float] | None:
    """(model state, 16 Psi/N + the largest unit, state / that - 1, the largest unit) of
    a ZeRO-3 row, in bytes: the largest unit is half the gathered peak (two slots)."""
    m = r["memory"]
    parts = [m.get(k) for k in ("mem_param_bytes", "mem_grad_bytes", "mem_optimizer_bytes")]
    gathered = m.get("zero_gathered_peak_bytes")
    if not (r["ok"] and all(parts) and gathered):
        return None
    state, unit = sum(parts), gathered / 2
    paper = 16 * psi / r["np"] + unit
    return state, paper, state / paper - 1, unit


def _state_models(data) -> list[tuple[str, int, list]]:
    """(name, Psi, rows) of the models whose ZeRO-3 state is checked."""
    model = data.get("plan", {}).get("model", {})
    models = [(f"{model.get('n_layers', '?')} blocks", data["params"], data["rows"])]
    if data.get("fine"):
        fine = data["plan"]["fine"]["model"]
        models.append((f"{fine['n_layers']} blocks", data["fine"]["params"], data["fine"]["rows"]))
    return models


def _state_row(r) -> bool:
    return r["stage"] == 3 and r["prefetch"] is True and r["where"] in (ONE, FINE)


def _state_table(data) -> list[str]:
    """ZeRO-3's model state per rank against 16 Psi/N + the largest unit, both models."""
    out = [
        "| model | Ψ | largest unit (MB) | np | model state (MB) | 16 Ψ/N + unit (MB) | over |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, psi, rows in _state_models(data):
        for r in (r for r in rows if _state_row(r)):
            got = state_over(r, psi)
            if got is None:
                out.append(f"| {name} | {psi / 1e6:.1f} M | | {r['np']} | **failed** | | |")
                continue
            state, paper, over, unit = got
            met = "" if over <= STATE_TARGET else " (over 10%)"
            out.append(
                f"| {name} | {psi / 1e6:.1f} M | {_mb(unit)} | {r['np']} | {_mb(state)} "
                f"| {_mb(paper)} | {over:+.1%}{met} |"
            )
    return out


def _speed_table(data) -> list[str]:
    out = [
        "| where | method | step (ms) | samples/s | vs ZeRO-2 | gather wait (ms/step) "
        "| sent (MB/step) | comm share | other load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        if r["step"] is None:
            continue
        z2 = find(data["rows"], r["where"], r["np"], 2)
        ok = r["ok"] and z2 and z2["ok"]
        vs = common.ratio(z2["step"], r["step"]) if ok else None
        wait = None if r["gather_wait_s"] is None else r["gather_wait_s"] * 1e3
        where = r["where"] + (" (10 Gbit/s)" if r["where"] == TWO else "")
        out.append(
            f"| {where}, np={r['np']} | {method(r)}{'' if r['ok'] else ' **failed**'} "
            f"| {common.fmt_mc(r['step'], 0, 1e3)} | {_num(r['samples_per_s'], '.2f')} "
            f"| {common.fmt_ratio(vs) if vs else ''} | {_num(wait, '.0f')} "
            f"| {_mb(r['memory'].get('comm_bytes'))} | {_num(r.get('comm_share'), '.2f')} "
            f"| {_num(r['foreign_load'], '.2f')} |"
        )
    return out


def _verdicts(data) -> list[str]:
    out = []
    for where, label in ((ONE, "one node, np=2"), (TWO, "two nodes x 1 rank, 10 Gbit/s")):
        r = data["ratios"].get(where, {})
        on, off, gain = r.get("on_vs_zero2"), r.get("off_vs_zero2"), r.get("prefetch_gain")
        if not on and not off:
            continue
        met = "n/a" if not on else ("met" if on["mean"] >= TARGETS[where] else "**not met**")
        out.append(
            f"- {label}: ZeRO-3 / ZeRO-2 throughput {common.fmt_ratio(on)} with prefetch "
            f"(target ≥ {TARGETS[where]}: {met}), {common.fmt_ratio(off)} without; "
            f"prefetch on / off: {common.fmt_ratio(gain)}{_estimate(data, where)}"
        )
    tf = data["ratios"].get(TF_ONE, {}).get("on_vs_zero2")
    if tf:
        out.append(
            f"- TensorFlow, one node, np=2: ZeRO-3 / ZeRO-2 throughput {common.fmt_ratio(tf)} "
            "with prefetch (each unit but the last runs forward again in backward, up to a "
            f"third more compute){_estimate(data, TF_ONE)}"
        )
    return out


def _estimate(data, where) -> str:
    est = no_overlap_estimate(data["rows"], where)
    return "" if est is None else f"; with nothing hidden (no_overlap_estimate) {est:.2f}"


def markdown(data, ctx) -> str:
    psi, p = data["params"], data["plan"]
    out = [
        f"{data['workload']}: Ψ = {psi / 1e6:.1f} M parameters ({_mb(4 * psi)} MB in "
        f"float32). ZeRO-3 gathers units of consecutive layers of at least "
        f"`train.zero_unit_mb: {p['unit_mb']:g}`, two live at a time.",
        "",
        "**Model-state memory per rank** (MB, one node, the last step's figures from "
        "metrics.jsonl, mean over ranks). (formula) = the ZeRO model the code reports: "
        "4/4/8 bytes per parameter without ZeRO; the parameters of ZeRO-3 are their 4 Ψ/N "
        "shard plus the two largest units (gathered peak = what was gathered at once). "
        "Plain data parallelism's grads held include the MPI engine's flat buffer (2 x 4 Ψ). "
        "Peak RSS is the whole process (torch, MPI, activations); RSS before the model is "
        "what it held just before building the model (the plot shows the difference).",
        "",
        *_memory_table(data),
        "",
        "**ZeRO-3's model state against the ZeRO paper's 16 Ψ/N plus the largest gathered "
        f"unit** (target: within {STATE_TARGET:.0%}; prefetch on, one node, the last step). "
        "Beyond the paper's one unit, ZeRO-3 holds the prefetched next unit and one unit's "
        "gradient being reduce-scattered (with the largest parameter's gradient copied "
        "into it): about 2 units more, so the target holds where a unit is at most about a "
        "fifth of a rank's parameter shard (4 Ψ/N bytes).",
        "",
        *_state_table(data),
        "",
        "**Throughput** (per-step mean ± 1.96·std after warm-up; samples/s over all ranks; "
        "vs ZeRO-2 = ZeRO-2's step / this step; gather wait = ZeRO-3's time blocked on "
        "parameter gathers; sent = bytes each rank sent per step):",
        "",
        *_speed_table(data),
        "",
        *_verdicts(data),
    ]
    if data.get("two_nodes_skipped"):
        out += ["", f"Two nodes skipped: {data['two_nodes_skipped']}."]
    return "\n".join(out) + "\n"


def plots(data, ctx) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    _plot_memory(ax, data)
    _plot_speed(ax2, data)
    fig.tight_layout()
    name = "zero_stages.png"
    fig.savefig(ctx.out / name, dpi=110)
    plt.close(fig)
    return [name]


def _plot_memory(ax, data) -> None:
    rows = [r for r in data["rows"] if r["where"] == ONE and r["prefetch"] is not False]
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    parts = (("mem_param_bytes", "parameters"), ("mem_grad_bytes", "gradients held"))
    for key, label in (*parts, ("mem_optimizer_bytes", "optimizer state")):
        ys = [(r["memory"].get(key) or 0) / 2**20 for r in rows]
        ax.bar(xs, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    model = [formula(r, data["params"]) for r in rows]
    ax.plot(xs, [sum(m) / 2**20 if all(m) else None for m in model], "kx", ms=9, label="formula")
    rss = [_growth(r["memory"]) for r in rows]
    ax.plot(xs, rss, "o", mfc="none", color="tab:red", label="peak RSS − RSS before the model")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"np={r['np']}\n{STAGES[r['stage']]}" for r in rows], fontsize=7)
    ax.set_ylabel("MB per rank")
    ax.set_title(f"Memory per rank, Ψ = {data['params'] / 1e6:.1f} M, Adam, one node")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _growth(m: dict) -> float | None:
    """MB the process grew by from just before the model to its peak."""
    peak, before = m.get("mem_peak_rss_bytes"), m.get("mem_rss_before_model_bytes")
    return (peak - before) / 2**20 if peak and before else None


def _plot_speed(ax, data) -> None:
    variants = [tuple(v) for v in data["plan"]["one_node"]]
    xs = list(range(len(variants)))
    places = ((ONE, "torch, one node"), (TWO, "torch, two nodes, 10 Gbit/s"), (TF_ONE, TF_ONE))
    for i, (where, label) in enumerate(places):
        at, ys, err = [], [], []
        for x, (stage, prefetch) in zip(xs, variants):
            r = find(data["rows"], where, 2, stage, prefetch)
            if r and r["ok"] and r["samples_per_s"]:
                at.append(x + (i - 1) * 0.28)
                ys.append(r["samples_per_s"])
                err.append(r["samples_per_s"] * r["step"]["conf"] / r["step"]["mean"])
        if ys:
            ax.bar(at, ys, 0.28, yerr=err, capsize=3, label=label)
    names = {
        (0, None): "plain",
        (3, True): "ZeRO-3\nprefetch on",
        (3, False): "ZeRO-3\nprefetch off",
    }
    ax.set_xticks(xs)
    ax.set_xticklabels([names.get(v, STAGES[v[0]]) for v in variants], fontsize=8)
    ax.set_ylabel("samples/s (2 ranks)")
    ax.set_title("Throughput per stage, np=2")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
