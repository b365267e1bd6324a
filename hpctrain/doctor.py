"""`hpctrain doctor`: is the whole stack here, and how are the ranks laid out?

Checks each piece a run needs (Python, numpy, mpi4py and its MPI library, h5py, torch,
TensorFlow, Horovod and what it was built with) and, under a launcher, prints the
layout every rank sees. Exits non-zero naming whatever is missing.

The World is made first, so a broken launch (launcher variables that disagree with MPI,
an MPI without thread support) is refused before anything heavy is imported. The
frameworks are an install per node, so each node probes them once: its first rank torch
and its second TensorFlow, side by side (a node of one rank probes both). The others
check only the core pieces, and import torch for the GPU column only on a node with an
NVIDIA or AMD GPU device. At 8 ranks a node that is 128 imports of each framework at
1,024 ranks and 512 at 4,096, instead of one per rank (about 5 s of CPU and a burst of
file-system metadata each).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version


def _pkg_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _check_core() -> tuple[list[tuple[str, str]], list[str]]:
    rows, missing = [("python", f"{platform.python_version()} ({sys.executable})")], []
    for dist in ("numpy", "pyyaml", "tqdm"):
        v = _pkg_version(dist)
        rows.append((dist, v or "MISSING"))
        if v is None:
            missing.append(dist)
    try:
        import mpi4py
        from mpi4py import MPI

        # Open MPI's string ends in a NUL, which made `hpctrain doctor | grep` see binary
        lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
        threads = {
            MPI.THREAD_MULTIPLE: "multiple",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SINGLE: "single",
        }
        rows.append(
            (
                "mpi4py",
                f"{mpi4py.__version__}; {lib}; MPI {MPI.Get_version()[0]}."
                f"{MPI.Get_version()[1]}; threads "
                f"{threads.get(MPI.Query_thread(), '?')}",
            )
        )
    except Exception as exc:  # noqa: BLE001 - report any import failure
        rows.append(("mpi4py", f"MISSING ({exc})"))
        missing.append("mpi4py")
    try:
        import h5py

        cfg = h5py.get_config()
        rows.append(
            (
                "h5py",
                f"{h5py.__version__}; HDF5 {h5py.version.hdf5_version}; "
                f"parallel HDF5 {'yes' if cfg.mpi else 'no'} (not needed: each rank "
                "writes its own shard file)",
            )
        )
    except Exception as exc:  # noqa: BLE001
        rows.append(("h5py", f"MISSING ({exc})"))
        missing.append("h5py")
    return rows, missing


def _check_backend(name: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Versions and Horovod build of one framework backend (imports it)."""
    try:
        info = importlib.import_module(f"hpctrain.backends.{name}").probe()
    except Exception as exc:  # noqa: BLE001 - not installed, or broken: named, not fatal
        return [(name, f"MISSING ({type(exc).__name__}: {exc})")], [name]
    rows = [(name, info["framework"]), (f"horovod[{name}]", info["horovod"])]
    missing = [f"{name}: {m}" for m in info.get("missing", [])]
    return rows, missing


BACKENDS = ("torch", "tensorflow")
# What a GPU's kernel driver makes: without any of them torch's CUDA (or ROCm) sees none.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")


def _backends_to_probe(layout) -> tuple[str, ...]:
    """The frameworks this rank probes: each once per node, over its first two ranks."""
    if layout is None or layout.local_size == 1:
        return BACKENDS
    return BACKENDS[layout.local_rank : layout.local_rank + 1]


def _visible_gpu_ids() -> list[str]:
    """The ids of the GPUs this rank sees ([] on a CPU node, without importing torch)."""
    if not any(os.path.exists(p) for p in GPU_DEVICE_FILES):
        return []  # a CPU node: no torch import on every rank for an empty column
    try:
        from .backends.torch_device import visible_gpu_ids

        return visible_gpu_ids()
    except Exception:  # noqa: BLE001 - doctor reports, never fails on this
        return []


def _gpu_of_rank(node_seen: list[list[str]], node_rank: int) -> str:
    """The GPU this rank computes on under runtime.device auto ("-": none): the node's
    ranks take one each among those each sees, as training does (assign_gpus)."""
    if not node_seen[node_rank]:
        return "-"
    from .runtime.devices import assign_gpus

    try:
        from .backends.torch import gpu_of_rank

        return gpu_of_rank(assign_gpus(node_seen)[node_rank])
    except Exception as exc:  # noqa: BLE001 - doctor reports, never fails on this
        return f"- ({type(exc).__name__})"


def _print_topology() -> None:
    """The node's GPU interconnect as `nvidia-smi topo -m` shows it, where it exists."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    print("\n  GPU topology (nvidia-smi topo -m, rank 0's node):")
    for line in out.splitlines()[:12]:
        print("    " + line)


def _node_framework_rows(layouts: list[dict] | None, own: dict[str, list]) -> list:
    """Rank 0's node's framework rows, in BACKENDS order, from whichever rank probed each."""
    found = dict(own)
    host = layouts[0]["hostname"] if layouts else None
    for lay in layouts or []:
        if lay["hostname"] == host:
            for backend, rows in lay["framework_rows"].items():
                found.setdefault(backend, rows)
    return [row for backend in BACKENDS for row in found.get(backend, [])]


def missing_by_host(layouts: list[dict] | None, failures: list[list[str]]) -> list[str]:
    """Each problem once, with the nodes that have it: a node installed apart from the
    others is named instead of hidden in a union. `layouts` and `failures` are per rank,
    in rank order (None: no MPI, one process). At 1,024 or 4,096 ranks the names stop
    after 8 nodes ("and N more"), and a problem every node has says so."""
    if layouts is None:
        return sorted({p for rank_missing in failures for p in rank_missing})
    every = {lay["hostname"] for lay in layouts}
    hosts_of: dict[str, set[str]] = {}
    for lay, rank_missing in zip(layouts, failures):
        for problem in rank_missing:
            hosts_of.setdefault(problem, set()).add(lay["hostname"])
    out = []
    for problem, hosts in sorted(hosts_of.items()):
        if hosts == every and len(every) > 1:
            where = "every node"
        else:
            names = sorted(hosts)
            where = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        out.append(f"{problem} (on {where})")
    return out


def run_doctor(quiet: bool = False) -> int:
    from .runtime import world

    rows, missing = _check_core()
    w = world() if "mpi4py" not in missing else None
    framework_rows: dict[str, list] = {}
    for backend in _backends_to_probe(w.layout if w is not None else None):
        framework_rows[backend], m = _check_backend(backend)
        missing += m
    if w is not None:
        node = w.node  # every rank: which GPUs each rank of its node sees
        seen = node.allgather_object(_visible_gpu_ids(), what="doctor: the GPUs ranks see")
        mine = {**w.layout.as_dict(), "gpu": _gpu_of_rank(seen, node.rank)}
        mine["framework_rows"] = framework_rows
        layouts = w.gather_object(mine, what="doctor: gather layouts")
        failures = w.gather_object(missing, what="doctor: gather problems")
    else:
        layouts, failures = None, [missing]
    if w is not None and not w.is_root:
        return 1 if missing else 0
    rows += _node_framework_rows(layouts, framework_rows)
    width = max(len(k) for k, _ in rows)
    if not quiet:
        print("hpctrain doctor")
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
    if layouts is not None and not quiet:
        print(f"\n  {len(layouts)} rank(s), launcher: {layouts[0]['launcher']}")
        gpus = any(lay["gpu"] != "-" for lay in layouts)
        print("  rank  local  local_size  node  host" + ("  gpu" if gpus else ""))
        for lay in layouts:
            print(
                f"  {lay['rank']:>4}  {lay['local_rank']:>5}  {lay['local_size']:>10}  "
                f"{lay['node']:>4}  {lay['hostname']}" + (f"  {lay['gpu']}" if gpus else "")
            )
        if gpus:
            _print_topology()
    problems = missing_by_host(layouts, failures)
    if problems:
        print("\ndoctor: MISSING: " + "; ".join(problems), file=sys.stderr)
        return 1
    if not quiet:
        print("\ndoctor: all checks passed")
    return 0
