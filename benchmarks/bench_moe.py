"""MoE token routing over mpi4py: hpctrain's dispatch+combine against two baselines.

Why: the MoE layer's cost beyond the experts' own math is routing plus two all-to-alls
per forward (two more in backward). This measures, on the same ranks and bytes:

- hpctrain: `MoELayer.plan` (top-k, capacity, Alltoall of counts) + dispatch and
  combine `Alltoallv`s of contiguous float32 rows, as the layer runs them;
- raw: `MPI.Alltoallv` of exactly the same row counts (the floor: no routing, no watchdog);
- naive: the approach of the seed code, a Python loop per token choice building
  per-rank lists and exchanging them with pickled `comm.alltoall`, then a loop to combine;
- a torch MoE layer step (forward + backward, `moe_ffn`) split into routing,
  all-to-all and expert compute.

    python benchmarks/bench_moe.py [--quick] [--json OUT]    (runs its own mpirun jobs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _median_time(fn, repeats: int, comm) -> float:
    """Median over repeats of the slowest rank's time (ranks start together)."""
    from mpi4py import MPI

    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = np.array([time.perf_counter() - t0])
        comm.Allreduce(dt.copy(), dt, op=MPI.MAX)
        times.append(float(dt[0]))
    return float(np.median(times))


def _exchange_bench(tokens: int, d: int, experts: int, k: int, repeats: int) -> dict:
    from hpctrain.moe.parallel import ExpertGroup, MoELayer
    from hpctrain.runtime import world

    group = ExpertGroup(world())  # the whole job
    comm, size, rank = group.comm, group.size, group.rank
    opts = {
        "experts": experts, "top_k": k, "capacity_factor": 1.25, "min_capacity": 0,
        "drop_tokens": True, "aux_loss": 0.01, "jitter": 0.0, "every": 1,
    }  # fmt: skip
    moe = MoELayer(opts, group)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)

    def hpctrain_path():
        plan = moe.plan(probs)
        recv = moe.exchange(x[plan.send_token], plan.send_rows, plan.recv_rows)
        back = moe.exchange(recv, plan.recv_rows, plan.send_rows)
        y = np.zeros_like(x)
        for slot in range(k):  # a token appears at most once per slot
            rows = plan.send_slot == slot
            y[plan.send_token[rows]] += back[rows]
        return y

    plan = moe.plan(probs)
    send = np.ascontiguousarray(x[plan.send_token])

    def raw_path():
        recv = group.alltoallv(send, plan.send_rows, plan.recv_rows)
        group.alltoallv(recv, plan.recv_rows, plan.send_rows)

    per_rank = experts // size

    def naive_path():  # per-token Python loop, pickled lists (seed-style)
        top = np.argsort(-probs, axis=1)[:, :k]
        outgoing = [[] for _ in range(size)]
        fill = [0] * experts
        cap = plan_cap
        for slot in range(k):
            for t in range(tokens):
                e = int(top[t, slot])
                if fill[e] < cap:
                    fill[e] += 1
                    outgoing[e // per_rank].append((t, x[t]))
        incoming = comm.alltoall(outgoing)
        returned = comm.alltoall([[(t, row) for t, row in rows] for rows in incoming])
        y = np.zeros_like(x)
        for rows in returned:
            for t, row in rows:
                y[t] += row
        return y

    plan_cap = int(np.ceil(k * tokens / experts * 1.25))
    bytes_moved = 2 * int(send.nbytes)  # dispatch + combine, this rank's send side
    total = np.array([float(bytes_moved)])
    comm.Allreduce(total.copy(), total)
    out = {
        "tokens_per_rank": tokens, "d_model": d, "experts": experts, "top_k": k,
        "bytes_per_step_all_ranks": int(total[0]),
    }  # fmt: skip
    for name, fn, reps in (
        ("hpctrain", hpctrain_path, repeats),
        ("hpctrain_plan_only", lambda: moe.plan(probs), repeats),
        ("raw_alltoallv", raw_path, repeats),
        ("naive_loop", naive_path, max(3, repeats // 5)),
    ):
        fn()  # warm-up
        s = _median_time(fn, reps, comm)
        out[f"{name}_seconds"] = s
        out[f"{name}_GBps"] = total[0] / s / 1e9
    out["hpctrain_vs_raw"] = out["hpctrain_seconds"] / out["raw_alltoallv_seconds"]
    out["naive_vs_hpctrain"] = out["naive_loop_seconds"] / out["hpctrain_seconds"]
    return out


def _layer_step_bench(tokens: int, d: int, ff: int, experts: int, k: int, repeats: int) -> dict:
    import torch

    from hpctrain.backends import torch_moe
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch import _Layer
    from hpctrain.models import zoo
    from hpctrain.moe.parallel import ExpertGroup, local_layers
    from hpctrain.runtime import world

    torch.set_num_threads(1)
    group = ExpertGroup(world())  # the whole job
    opts = {
        "experts": experts, "top_k": k, "capacity_factor": 1.25, "min_capacity": 0,
        "drop_tokens": True, "aux_loss": 0.01, "jitter": 0.0, "every": 1,
    }  # fmt: skip
    ffn = {"fc1.weight": (ff, d), "fc1.bias": (ff,), "fc2.weight": (d, ff), "fc2.bias": (d,)}
    params = {"moe.router.weight": (experts, d)}
    params.update({f"moe.experts.{e}.{n}": s for e in range(experts) for n, s in ffn.items()})
    spec = zoo.LayerSpec("block", "blocks.0", params, attrs={"n_heads": 1, "moe": opts})
    weights = zoo.init_weights([spec], 0)
    layer = _Layer(local_layers([spec], 0, group)[0], ModelGroups(experts=group))
    with torch.no_grad():
        for n, p in layer.p.items():
            p.copy_(torch.from_numpy(weights[f"blocks.0.{n}"]))
    layer.train()
    h = torch.randn(1, tokens, d, generator=torch.Generator().manual_seed(group.rank))

    def step():
        y = torch_moe.moe_ffn(layer, h)
        (y.square().mean() + torch_moe.aux_loss(layer)).backward()

    step()
    torch_moe.step_extra(layer, 1.0)  # reset counters after warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        group.comm.Barrier()
        step()
    total = time.perf_counter() - t0
    m = torch_moe.step_extra(layer, total)
    per = 1.0 / repeats
    split = {
        "step_seconds": total * per,
        "routing_seconds": m["moe_routing_seconds"] * per,
        "alltoall_seconds": m["moe_alltoall_seconds"] * per,
        "expert_forward_seconds": m["moe_expert_seconds"] * per,
    }
    split["other_seconds"] = split["step_seconds"] - sum(
        split[k] for k in ("routing_seconds", "alltoall_seconds", "expert_forward_seconds")
    )  # autograd of gate/gather/scatter, expert backward, barrier wait
    split["alltoall_share"] = split["alltoall_seconds"] / split["step_seconds"]
    split["tokens_per_sec"] = tokens * group.size * repeats / total
    avg = np.array([split[key] for key in sorted(split)])
    group.comm.Allreduce(avg.copy(), avg)
    return {key: float(v) / group.size for key, v in zip(sorted(split), avg, strict=True)}


def worker(args) -> None:
    from hpctrain.runtime import world

    w = world()
    shapes = [(256, 64)] if args.quick else [(256, 64), (2048, 128)]
    repeats = 10 if args.quick else 30
    result = {"ranks": w.size, "exchange": [], "layer_step": []}
    for tokens, d in shapes:
        result["exchange"].append(_exchange_bench(tokens, d, 4 * w.size, 2, repeats))
        result["layer_step"].append(_layer_step_bench(tokens, d, 2 * d, 4 * w.size, 2, repeats))
    if w.rank == 0:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one size, np=2 only, fewer repeats")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--np", type=int, nargs="*", help="rank counts (default 2 4; quick: 2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mpirun job")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    counts = args.np or ([2] if args.quick else [2, 4])
    results, failures = [], []
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = ["mpirun", "-np", str(n), *(["--oversubscribe"] if n > 2 else [])]
            cmd += [sys.executable, __file__, "--worker", "--json", str(out)]
            cmd += ["--quick"] if args.quick else []
            env = {**os.environ, **ENV, "OMPI_MCA_mpi_yield_when_idle": "1"}
            try:
                job = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT
                )
            except subprocess.TimeoutExpired:
                failures.append(f"np={n}: timed out after {args.timeout} s")
                continue
            if job.returncode != 0 or not out.exists():
                failures.append(f"np={n}: exit {job.returncode}\n{job.stdout[-2000:]}")
                continue
            results.append(json.loads(out.read_text()))
    report = {"benchmark": "moe", "quick": args.quick, "results": results, "failures": failures}
    for r in results:
        for ex, st in zip(r["exchange"], r["layer_step"], strict=True):
            print(
                f"np={r['ranks']} T={ex['tokens_per_rank']} d={ex['d_model']} "
                f"E={ex['experts']} k=2: dispatch+combine {ex['hpctrain_seconds'] * 1e3:.2f} ms "
                f"(raw Alltoallv {ex['raw_alltoallv_seconds'] * 1e3:.2f} ms, x"
                f"{ex['hpctrain_vs_raw']:.2f}, of which routing plan "
                f"{ex['hpctrain_plan_only_seconds'] * 1e3:.2f} ms; per-token loop "
                f"{ex['naive_loop_seconds'] * 1e3:.1f} ms, x{ex['naive_vs_hpctrain']:.1f} slower); "
                f"layer step {st['step_seconds'] * 1e3:.1f} ms = routing "
                f"{st['routing_seconds'] * 1e3:.2f} + all-to-all {st['alltoall_seconds'] * 1e3:.2f}"
                f" + expert fwd {st['expert_forward_seconds'] * 1e3:.2f} + other "
                f"{st['other_seconds'] * 1e3:.2f} ms, {st['tokens_per_sec']:.0f} tokens/s"
            )
    for f in failures:
        print("FAILED", f, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
