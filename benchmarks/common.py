"""Plumbing every benchmark section shares: mpirun jobs, statistics, machine facts.

Why a module of its own: each measurement must be launched the same way (same mpirun
flags, same hard timeout, same environment), and each must record how busy the machine
was with *other* work while it ran, because on a shared 2-core box a neighbour's test
run halves a throughput figure without leaving any other trace.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .threadcpu import NamespaceCpu, ThreadSampler

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
VENV_BIN = Path(sys.executable).parent
PYTHON = sys.executable
HPCTRAIN = str(VENV_BIN / "hpctrain")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclass
class Context:
    """One benchmark run: options, output folder, and every job's record."""

    out: Path
    quick: bool
    cores: int
    deadline: float  # time.monotonic() after which sections skip optional work
    results: dict = field(default_factory=dict)  # section name -> its data (for later ones)
    jobs: list = field(default_factory=list)  # every mpirun command, for results.json
    alpha: float | None = None
    beta: float | None = None
    network: str | None = None

    def scratch(self, name: str) -> Path:
        path = self.out / "work" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Job:
    cmd: list[str]
    env: dict
    returncode: int
    output: str
    seconds: float
    cpu_seconds: float  # CPU time of the job's processes (user + system)
    foreign_load: float | None  # cores busy with other work during the job (mean)
    threads: dict | None = None  # ThreadSampler.stop(): CPU shares of the ranks' threads

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def record(self) -> dict:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()) if k not in MPI_ENV)
        return {
            "command": (env + " " if env else "") + shlex.join(self.cmd),
            "returncode": self.returncode,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "foreign_load_cores": None
            if self.foreign_load is None
            else round(self.foreign_load, 2),
        }


def _busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine so far (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def mpirun(
    ctx: Context,
    np_: int,
    args: list[str],
    timeout: float,
    env: dict | None = None,
    mpi_args: list[str] | None = None,
    sample_threads: bool = False,
) -> Job:
    """Run `args` on `np_` ranks under a hard timeout; stdout and stderr together.

    More ranks than cores get `--oversubscribe`. The job's record (command, time, CPU,
    other load) is appended to `ctx.jobs`. A timed-out job is killed with its whole
    process group and reported with returncode 124.
    """
    cmd = ["mpirun", "-np", str(np_)]
    if np_ > ctx.cores:
        cmd.append("--oversubscribe")
    cmd += list(mpi_args or []) + list(args)
    full_env = dict(os.environ)
    full_env.update(MPI_ENV)
    full_env.update({"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    full_env.update(env or {})
    # Ranks on emulated nodes are not this process's reaped children: sample them there.
    on_nodes = any("plm_rsh_agent" in a for a in mpi_args or [])
    nodes_cpu = NamespaceCpu().start() if on_nodes else None
    busy0, cpu0, t0 = _busy_seconds(), _children_cpu(), time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=ROOT,
        start_new_session=True,
    )
    sampler = ThreadSampler(proc.pid).start() if sample_threads else None
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += f"\n[bench] killed after {timeout:.0f} s\n"
        code = 124
    seconds = time.monotonic() - t0
    threads = sampler.stop() if sampler else None
    cpu = _children_cpu() - cpu0 + (nodes_cpu.stop() if nodes_cpu else 0.0)
    busy1 = _busy_seconds()
    foreign = None
    if busy0 is not None and busy1 is not None and seconds > 0:
        foreign = max(0.0, (busy1 - busy0 - cpu) / seconds)
    job = Job(cmd, dict(env or {}), code, out, seconds, cpu, foreign, threads)
    ctx.jobs.append(job.record())
    tag = "ok" if job.ok else f"FAILED rc={code}"
    print(f"[bench] {seconds:6.1f} s {tag}: {job.record()['command']}", flush=True)
    if not job.ok:
        print("\n".join(out.splitlines()[-15:]), flush=True)
    return job


# --- statistics ---------------------------------------------------------------------
def mean_conf(values) -> dict:
    """Horovod's synthetic-benchmark summary: mean and 1.96 * std over iterations."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    if arr.size == 0:
        return {"mean": None, "conf": None, "n": 0}
    return {"mean": float(arr.mean()), "conf": float(1.96 * arr.std()), "n": int(arr.size)}


def ratio(a: dict | None, b: dict | None) -> dict | None:
    """a/b of two mean_conf results, with the interval from relative errors in quadrature."""
    if not a or not b or not a.get("mean") or not b.get("mean"):
        return None
    r = a["mean"] / b["mean"]
    rel = math.hypot(a["conf"] / a["mean"], b["conf"] / b["mean"])
    return {"mean": r, "conf": r * rel}


def fmt_mc(mc: dict | None, digits: int = 1, scale: float = 1.0) -> str:
    if not mc or mc.get("mean") is None:
        return "n/a"
    return f"{mc['mean'] * scale:.{digits}f} ± {mc['conf'] * scale:.{digits}f}"


def fmt_pct(mc: dict | None) -> str:
    if not mc or mc.get("mean") is None:
        return "n/a"
    return f"{mc['mean'] * 100:.0f}% ± {mc['conf'] * 100:.0f}"


def fmt_ratio(mc: dict | None) -> str:
    return fmt_mc(mc, 2)


# --- facts about the machine and the software -----------------------------------------
def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "ram_gib": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def versions() -> dict:
    """Versions of everything measured, read from package metadata (no heavy imports)."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "tensorflow-cpu", "tensorflow", "horovod", "mpi4py", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    try:
        line = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
        out["mpirun"] = line.strip()
    except (OSError, IndexError, subprocess.TimeoutExpired):
        out["mpirun"] = None
    from hpctrain.version import __version__

    out["hpctrain"] = __version__
    with contextlib.suppress(OSError):
        out["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        changed = subprocess.run(  # tracked files edited since that commit (no index lock)
            ["git", "diff", "--quiet", "HEAD"], capture_output=True, cwd=ROOT
        ).returncode == 1  # fmt: skip
        if changed and out["git_commit"]:
            out["git_commit"] += " (with uncommitted changes)"
    return out


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
