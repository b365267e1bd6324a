"""The GPU section of `make bench` (runs only where torch sees a CUDA GPU).

Side by side in one process tree, on one GPU, same model, batch and precision (bf16
autocast, float32 master weights, Adam, clip 1.0):
- plain:  a hand-written torch loop over the same nn.Module (hpctrain's zoo transformer,
          SDPA attention), batches already on the GPU: the ceiling for hpctrain;
- ddp:    the same loop under torch DDP over NCCL at np=1;
- hpctrain: `hpctrain train` itself (one rank, runtime.device=cuda, the nccl engine),
          its own data path included, throughput from metrics.jsonl's steps.
Tokens/s, MFU = 6 N tokens/s over the device's dense bf16 peak, the plain loop's step
split into forward+backward and optimizer (CUDA events; hpctrain at np=1 exchanges
nothing, and its data path is measured apart), the
host-staged MPI engine's cost per MB, the data path's rate against the step's, and
what an async checkpoint costs the steps around it (the state copied inside the save
call against staged into pinned memory beside the next step).

    python3 benchmarks/gpu_bench.py --out DIR [--steps 30] [--sizes base,large] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Dense bf16 tensor-core peaks (datasheets, without sparsity), for MFU.
PEAK_BF16 = {"H100 80GB HBM3": 989e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}

SIZES = {  # d_model, layers, heads, d_ff, vocab, seq, batch
    "base": (1024, 8, 16, 4096, 16384, 1024, 16),
    "large": (2048, 8, 16, 8192, 16384, 1024, 8),
    "dry": (64, 2, 4, 128, 512, 32, 4),  # --dry-run, on the CPU: the code, no figures
}


def peak_flops(name: str) -> float:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return float("nan")


def transformer_overrides(size: str) -> list[str]:
    d, layers, heads, ff, vocab, seq, batch = SIZES[size]
    return [
        "model.name=transformer",
        "data.task=tokens",
        f"model.d_model={d}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.d_ff={ff}",
        f"data.vocab={vocab}",
        f"data.seq_len={seq}",
        f"train.batch_size={batch}",
        "train.precision=bf16",
        "train.deterministic=false",
        "train.clip_norm=1.0",
        "optimizer.name=adam",
        "optimizer.lr=1e-4",
        "optimizer.lr_scaling=none",
        "runtime.device=cuda",
        "metrics.tensorboard=false",
    ]


def _model_and_batch(size: str):
    import torch

    from hpctrain.backends.torch import build_model
    from hpctrain.config import Config
    from hpctrain.models import zoo

    d, layers, heads, ff, vocab, seq, batch = SIZES[size]
    cfg = Config.load(None, transformer_overrides(size))
    inp = zoo.InputSpec(shape=(seq,), classes=vocab, tokens=True)
    model = build_model(cfg.model, inp, 0).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    y = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    return model, x, y, n_params, batch * seq


def _loop(model, x, y, steps: int, fused=True):
    """Median seconds per step of the hand-written loop (and the phase split), by CUDA
    events around each step, synchronised after each timed one."""
    import torch

    marks: list = []  # (start, after backward, end) events of the step under way
    step = _plain_step(model, x, y, fused, between=lambda: marks[-1][1].record())
    times, phases = [], {"forward_backward": [], "optimizer": []}
    for i in range(steps + 3):
        marks.append([torch.cuda.Event(enable_timing=True) for _ in range(3)])
        t0, t1, t2 = marks[-1]
        t0.record()
        step()
        t2.record()
        if i >= 3:
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t2) / 1e3)
            phases["forward_backward"].append(t0.elapsed_time(t1) / 1e3)
            phases["optimizer"].append(t1.elapsed_time(t2) / 1e3)
    return float(np.median(times)), {k: float(np.median(v)) for k, v in phases.items()}


def _plain_step(model, x, y, fused=True, between=None):
    """One step of the hand-written loop (bf16 autocast, clip 1.0, Adam: fused, as
    hpctrain builds it on a GPU rank, so only the loop differs; or torch's default).
    `between()`: called after backward, before the clip and the update."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if between is not None:
            between()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def _wall(step, steps: int) -> float:
    """Seconds per step over `steps` queued back to back (the host runs ahead, as in a
    real loop; one synchronisation at each end), after 3 warm-up steps."""
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def kernel_profile(step, steps: int = 5) -> dict:
    """Wall seconds and summed GPU kernel seconds per step under torch's profiler, and
    each kernel's launches and microseconds per step (where a step's GPU time goes)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    per_step = {n: [c / steps, us / steps] for n, (c, us) in kernels.items()}
    busy = sum(us for _, us in per_step.values()) / 1e6
    return {"wall_s": wall, "kernel_s": busy, "kernels": per_step}


def kernel_diff(a: dict, b: dict, top: int = 12) -> list[tuple[str, float, float, float]]:
    """(kernel, launches a, launches b, microseconds b - a) per step, largest first."""
    names = set(a["kernels"]) | set(b["kernels"])
    rows = []
    for n in names:
        ca, ua = a["kernels"].get(n, [0, 0.0])
        cb, ub = b["kernels"].get(n, [0, 0.0])
        rows.append((n, ca, cb, ub - ua))
    rows.sort(key=lambda r: -abs(r[3]))
    return rows[:top]


def _hpctrain_backend(size: str, device: str = "cuda"):
    """hpctrain's torch backend for `size` on this GPU (one rank, no MPI job), and one
    step's micro-batch as the loop hands it over (host numpy arrays). device="cpu":
    the same on the CPU (a dry run of the bench's code where there is no GPU)."""
    from hpctrain.backends.torch import TorchBackend
    from hpctrain.config import Config
    from hpctrain.models import zoo

    d, layers, heads, ff, vocab, seq, batch = SIZES[size]
    engine = "train.allreduce=nccl" if device == "cuda" else "train.allreduce=gloo"
    on = [f"runtime.device={device}", engine]
    if device == "cpu":
        on.append("train.precision=fp32")
    cfg = Config.load(None, transformer_overrides(size) + on)
    inp = zoo.InputSpec(shape=(seq,), classes=vocab, tokens=True)
    backend = TorchBackend(cfg, None, inp, threads=4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    y = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    return backend, [(x, y)]


def bench_step_gap(size: str, steps: int, profile: bool) -> dict:
    """hpctrain's step alone (`TorchBackend.train_step`, batches from host numpy, no
    loop, no data reader, no metrics; counting no correct predictions, as the loop's
    unlogged steps and the plain step do) against the plain step, both timed by wall clock
    back to back; with `profile`, the kernels each runs per step and their difference."""
    import torch

    model, x, y, _, _ = _model_and_batch(size)
    plain = _plain_step(model, x, y)
    out = {"plain_wall_step_s": _wall(plain, steps)}
    if profile:
        out["plain_profile"] = kernel_profile(plain)
    del plain, model
    torch.cuda.empty_cache()
    out.update(_time_hpctrain_step(size, steps, profile))
    torch.cuda.empty_cache()  # the backend is gone with the helper's frame
    if profile:
        out["kernel_diff"] = kernel_diff(out["plain_profile"], out["hpctrain_step_profile"])
    return out


def _time_hpctrain_step(size: str, steps: int, profile: bool) -> dict:
    backend, mb = _hpctrain_backend(size)

    def step():
        backend.train_step(mb, 1e-4, tally=False)

    out = {"hpctrain_step_wall_s": _wall(step, steps)}
    if profile:
        out["hpctrain_step_profile"] = kernel_profile(step)
    return out


def bench_plain_and_ddp(size: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    model, x, y, n_params, tokens = _model_and_batch(size)
    plain, split = _loop(model, x, y, steps)
    foreach, foreach_split = _loop(model, x, y, steps, fused=False)  # torch's default Adam
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    ddp, _ = _loop(ddp_model, x, y, steps)
    dist.destroy_process_group()
    del ddp_model, model
    torch.cuda.empty_cache()
    return {
        "params": n_params,
        "tokens_per_step": tokens,
        "plain_step_s": plain,
        "plain_split_s": split,
        "plain_foreach_adam_step_s": foreach,
        "plain_foreach_adam_split_s": foreach_split,
        "ddp_step_s": ddp,
    }


def bench_hpctrain(size: str, steps: int, out: Path) -> dict:
    run = out / f"hpctrain-{size}"
    cmd = [
        sys.executable, "-m", "hpctrain", "train", "--run-dir", str(run), "--new",
    ]  # fmt: skip
    d, layers, heads, ff, vocab, seq, batch = SIZES[size]
    for o in transformer_overrides(size) + [
        f"train.max_steps={steps + 5}",
        "train.log_every=10",  # the default: accuracy counted on 1 step in 10
        f"data.train_samples={batch * (steps + 5)}",
        f"data.val_samples={batch}",
        "checkpoint.enabled=false",
        "train.allreduce=nccl",
    ]:
        cmd += ["--set", o]
    t0 = time.time()
    try:  # ~50 s on an H100; well inside the check's bench step
        job = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"hpctrain train did not end within {exc.timeout:g} s"}
    (out / f"hpctrain-{size}.log").write_text(job.stdout + job.stderr)
    if job.returncode != 0:
        return {"error": (job.stdout + job.stderr)[-2000:]}
    lines = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    steps_ = [x for x in lines if x.get("event") == "step" and x["step"] > 5]
    peak = [x.get("mem_cuda_peak_allocated_bytes", 0) for x in steps_]
    # The step time from the logged steps' timestamps: each line is written when its
    # report settles, a fixed number of steps after it (one or two), so the offset
    # cancels between two of them; the last step (drained at once) is left out. Not a
    # logged step's own wall time: with the host a step ahead of the GPU those alternate
    # (seen on the H100: 37.8 ms against 38.8 for the step alone).
    timed = [x for x in steps_ if x["step"] < steps + 5]
    if len(timed) < 2:
        return {"error": f"fewer than 2 logged steps between step 6 and {steps + 4}"}
    first, last = timed[0], timed[-1]
    return {
        "step_s": (last["time"] - first["time"]) / (last["step"] - first["step"]),
        "steps_timed": last["step"] - first["step"],
        "wall_s": time.time() - t0,
        "cuda_peak_allocated_gib": max(peak) / 2**30 if peak else None,
    }


def bench_checkpoint_stall(
    size: str, directory: Path, steps: int = 8, reps: int = 3, device: str = "cuda"
) -> dict:
    """What an async save of a GPU rank's state costs the steps around it: `steps` steps
    queued back to back with a save after the first, against the same steps without
    one, for the state copied to the host inside the save call (pageable copies:
    `export_state()`) and staged (pinned buffers filled on a side stream beside the next
    step: `export_state(staged=True)`, what the loop does with checkpoint.async). Also
    the save call's own time on the host. The background thread writes the file during
    the timed steps, as in training; its end is awaited outside them."""
    import shutil

    import torch

    from hpctrain.checkpoint import Checkpointer, CheckpointPolicy

    backend, mb = _hpctrain_backend(size, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ck = Checkpointer(CheckpointPolicy({"dir": str(directory), "async": True, "keep_last": 1}))
    saved = [0]

    def save(staged: bool) -> float:  # what the checkpoint session does on rank 0
        t0 = time.perf_counter()
        ck.fence()
        state = backend.export_state(staged=staged)
        hold = backend.hold_exported_state(ck.fence)
        saved[0] += 1
        ck.save(saved[0], state, {"step": saved[0]}, private=True, defer_copy=hold,
                ready=backend.wait_exported)  # fmt: skip
        return time.perf_counter() - t0

    def window(mode: str) -> tuple[float, float]:
        sync()
        t0, call = time.perf_counter(), 0.0
        for i in range(steps):
            backend.train_step(mb, 1e-4, tally=False)
            if i == 0 and mode != "none":
                call = save(mode == "staged")
        sync()
        wall = time.perf_counter() - t0
        ck.wait()
        return wall, call

    modes = ("none", "copied", "staged")
    for mode in modes:  # warm-up: kernels, the save's host buffers, the pinned mirror
        window(mode)
    runs = {mode: [] for mode in modes}
    for _ in range(reps):  # interleaved, so drifts touch every mode alike
        for mode in modes:
            runs[mode].append(window(mode))
    shutil.rmtree(directory, ignore_errors=True)
    state_bytes = sum(v.nbytes for v in backend.export_state().values())
    base = float(np.median([w for w, _ in runs["none"]]))
    out = {"model": f"transformer-{size}", "state_gib": state_bytes / 2**30, "steps": steps}
    out["window_ms"] = 1e3 * base
    for mode in modes[1:]:
        out[f"{mode}_stall_ms"] = 1e3 * (float(np.median([w for w, _ in runs[mode]])) - base)
        out[f"{mode}_call_ms"] = 1e3 * float(np.median([c for _, c in runs[mode]]))
    return out


def bench_staging(mb: int = 256) -> dict:
    """The host-staged MPI engine's extra cost: device -> pageable host -> device."""
    import torch

    n = mb * 2**20 // 4
    dev = torch.randn(n, device="cuda")
    host = np.empty(n, dtype=np.float32)
    for _ in range(2):
        torch.from_numpy(host).copy_(dev)
        dev.copy_(torch.from_numpy(host).cuda())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        torch.from_numpy(host).copy_(dev)
        dev.copy_(torch.from_numpy(host).to("cuda"))
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / reps
    return {"staged_mb": mb, "round_trip_ms_per_mb": 1e3 * per / mb}


def bench_data_path(size: str, step_s: float, out: Path, device: str = "cuda") -> dict:
    """Samples/s the host side delivers (hpctrain's synthetic token data through the
    DeviceFeeder onto the GPU) against the samples/s the step consumes."""
    import torch

    from hpctrain.backends.torch_device import DeviceFeeder
    from hpctrain.config import Config
    from hpctrain.data import prepare_dataset
    from hpctrain.data.sharded import ShardedTrainData

    d, layers, heads, ff, vocab, seq, batch = SIZES[size]
    cfg = Config.load(
        None,
        transformer_overrides(size)
        + [f"data.train_samples={batch * 20}", f"data.val_samples={batch}", "data.prefetch=2"],
    )
    from hpctrain.runtime import world

    dataset = prepare_dataset(cfg, world(), out)
    data = ShardedTrainData(dataset, 0, 1, batch, 1, 0, 2)
    feeder = DeviceFeeder(torch.device(device))
    count, t0 = 0, time.perf_counter()
    for mb in data.iterate(0, 0):
        for x, y in mb:
            feeder.put(x), feeder.put(y)
            count += len(x)
    if device == "cuda":
        torch.cuda.synchronize()
    rate = count / (time.perf_counter() - t0)
    need = batch / step_s
    return {"data_samples_per_s": rate, "step_samples_per_s": need, "ratio": rate / need}


def checkpoint_line(c: dict) -> str:
    if "error" in c:
        return f"Async checkpoint of a GPU rank: failed: {c['error'][:300]}"
    return (
        f"Async checkpoint of a GPU rank ({c['model']}, {c['state_gib']:.2f} GiB of "
        f"state, {c['steps']} steps of {c['window_ms']:.0f} ms in all around each save): "
        f"copied inside the save call, the steps take {c['copied_stall_ms']:+.1f} ms "
        f"(the call {c['copied_call_ms']:.1f} ms); staged beside the next step "
        f"{c['staged_stall_ms']:+.1f} ms (the call {c['staged_call_ms']:.1f} ms)."
    )


def dry_run(out: Path) -> dict:
    """The sections that take a device, on the CPU at a tiny size: hpctrain's step, an
    async checkpoint's stall and the data path, each with its report line. No figures:
    the bench's own code runs where there is no GPU (tests/test_gpu_bench.py), so a slip
    in it is found here rather than in a GPU loan. The sections that time CUDA events,
    the profiler's kernels or DDP over NCCL run on a GPU only."""
    backend, mb = _hpctrain_backend("dry", "cpu")
    stats = backend.train_step(mb, 1e-4, tally=False)
    ckpt = bench_checkpoint_stall("dry", out / "dry-ckpt", steps=2, reps=1, device="cpu")
    data = bench_data_path("dry", 1.0, out, device="cpu")
    return {
        "loss_sum": float(stats.loss_sum),
        "checkpoint": ckpt,
        "checkpoint_line": checkpoint_line(ckpt),
        "data_path": data,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sizes", default="base")
    ap.add_argument("--profile", action="store_true", help="kernels per step, plain vs hpctrain")
    ap.add_argument(
        "--dry-run", action="store_true", help="the device sections' code on the CPU, tiny"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(json.dumps(dry_run(args.out), indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu bench: skipped, torch sees no CUDA GPU")
        return
    name = torch.cuda.get_device_name(0)
    report = {"device": name, "torch": torch.__version__, "sections": {}}
    for size in args.sizes.split(","):
        r = bench_plain_and_ddp(size, args.steps)
        r["hpctrain"] = bench_hpctrain(size, args.steps, args.out)
        flops = 6 * r["params"] * r["tokens_per_step"]
        peak = peak_flops(name)
        for key in ("plain_step_s", "ddp_step_s", "plain_foreach_adam_step_s"):
            r[key.replace("step_s", "mfu")] = flops / r[key] / peak
        h = r["hpctrain"]
        if "step_s" in h:
            h["mfu"] = flops / h["step_s"] / peak
            h["tokens_per_s"] = r["tokens_per_step"] / h["step_s"]
            h["vs_plain"] = r["plain_step_s"] / h["step_s"]
            h["vs_ddp"] = r["ddp_step_s"] / h["step_s"]
            print(json.dumps({size: r}, indent=1), flush=True)  # before what may fail
            try:
                r["data_path"] = bench_data_path(size, h["step_s"], args.out)
            except Exception as exc:  # noqa: BLE001 - reported, the figures above kept
                r["data_path"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:  # after hpctrain's run, so the plain loop is timed on either side of it
            r["step_gap"] = bench_step_gap(size, args.steps, args.profile)
        except Exception as exc:  # noqa: BLE001 - reported, the figures above kept
            r["step_gap"] = {"error": f"{type(exc).__name__}: {exc}"}
        if "step_s" in h and "plain_wall_step_s" in r["step_gap"]:
            # against the faster of the plain loop's two timings (events with a sync per
            # step before hpctrain's run, wall clock back to back after it)
            best = min(r["plain_step_s"], r["step_gap"]["plain_wall_step_s"])
            h["vs_plain"] = best / h["step_s"]
            h["vs_plain_step_alone"] = best / r["step_gap"]["hpctrain_step_wall_s"]
        report["sections"][size] = r
        print(json.dumps({size: r}, indent=1), flush=True)
        (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))  # so far
    report["staging"] = bench_staging()
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"# GPU bench on {name} (torch {torch.__version__})", ""]
    lines.append(
        "| model | params | plain tok/s | DDP tok/s | hpctrain tok/s | hpctrain/plain "
        "| MFU plain | MFU hpctrain | data/step |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for size, r in report["sections"].items():
        h = r["hpctrain"]
        tok = r["tokens_per_step"]
        lines.append(
            f"| transformer-{size} | {r['params'] / 1e6:.0f} M | {tok / r['plain_step_s']:,.0f} "
            f"| {tok / r['ddp_step_s']:,.0f} | {h.get('tokens_per_s', float('nan')):,.0f} "
            f"| {h.get('vs_plain', float('nan')):.3f} | {r['plain_mfu']:.1%} "
            f"| {h.get('mfu', float('nan')):.1%} "
            f"| {r.get('data_path', {}).get('ratio', float('nan')):.1f}x |"
        )
    lines += [
        "",
        "plain tok/s: CUDA events around each step (one sync per step); hpctrain/plain: "
        "against the faster of that and the plain loop's wall-clock timing below; "
        "hpctrain: the mean of every step's wall time (steps 6 on) of `hpctrain train`.",
        "",
        "Where the gap to the plain loop lies (wall clock, steps queued back to back; the "
        "plain loop timed again after hpctrain's run; hpctrain's step alone is "
        "`TorchBackend.train_step` on host batches, no loop, reader or metrics, and no "
        "accuracy count, as on the loop's unlogged steps):",
        "",
        "| model | plain (events) ms | plain (wall, after) ms | hpctrain step ms | "
        "hpctrain loop ms | step / plain | loop / step |",
        "|---|---|---|---|---|---|---|",
    ]
    kernels = []  # each model's kernel table, after the step-gap table
    for size, r in report["sections"].items():
        g, h = r.get("step_gap", {}), r["hpctrain"]
        if "plain_wall_step_s" not in g or "step_s" not in h:
            lines.append(f"| transformer-{size} | {g.get('error', h.get('error', '?'))[:200]} |")
            continue
        pw, hs, hl = g["plain_wall_step_s"], g["hpctrain_step_wall_s"], h["step_s"]
        lines.append(
            f"| transformer-{size} | {1e3 * r['plain_step_s']:.2f} | {1e3 * pw:.2f} "
            f"| {1e3 * hs:.2f} | {1e3 * hl:.2f} | {pw / hs:.3f} | {hs / hl:.3f} |"
        )
        if "kernel_diff" in g:
            a, b = g["plain_profile"], g["hpctrain_step_profile"]
            kernels += [
                "",
                f"transformer-{size} under the profiler: plain {1e3 * a['wall_s']:.2f} ms wall, "
                f"{1e3 * a['kernel_s']:.2f} ms of kernels; hpctrain's step "
                f"{1e3 * b['wall_s']:.2f} ms wall, {1e3 * b['kernel_s']:.2f} ms of kernels.",
                "",
                "| kernel | launches plain | launches hpctrain | hpctrain - plain us/step |",
                "|---|---|---|---|",
            ]
            for name, ca, cb, dus in g["kernel_diff"]:
                kernels.append(f"| {name[:90]} | {ca:g} | {cb:g} | {dus:+.0f} |")
    lines += kernels
    s = report["staging"]
    lines += [
        "",
        f"Host-staged MPI engine: {s['round_trip_ms_per_mb']:.3f} ms per MB of "
        f"gradients (device -> host -> device, {s['staged_mb']} MB, pageable host memory).",
    ]
    (args.out / "gpu_report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:  # last: the report above is kept if this runs out of the check's time
        # a folder of its own (the bench removes it after): never one already in --out
        ckpt_dir = Path(tempfile.mkdtemp(prefix="ckpt-", dir=args.out))
        report["checkpoint"] = bench_checkpoint_stall("base", ckpt_dir)
    except Exception as exc:  # noqa: BLE001 - reported, the figures above kept
        report["checkpoint"] = {"error": f"{type(exc).__name__}: {exc}"}
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    lines += ["", checkpoint_line(report["checkpoint"])]
    (args.out / "gpu_report.md").write_text("\n".join(lines) + "\n")
    print(lines[-1])
    failed = [
        f"{size}: {part}"
        for size, r in report["sections"].items()
        for part, v in r.items()
        if isinstance(v, dict) and "error" in v
    ] + (["checkpoint"] if "error" in report["checkpoint"] else [])
    if failed:  # the report keeps what was measured; the check records the failure
        sys.exit(f"GPU bench: {len(failed)} part(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
