"""Process memory facts: measured by the kernel, and the limit the kernel will enforce.

`rank_memory_limit` finds the bytes this rank may use before the kernel's OOM killer (a
cgroup: SLURM's `--mem`/`--mem-per-cpu` with cgroup enforcement, a container, systemd)
ends it, so a run that cannot fit is refused with the figures before any compute instead
of dying mid-step with a SIGKILL.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1


def peak_rss_bytes() -> int:
    """The highest resident set size since `reset_peak_rss` (the run's start), else this
    process's (Linux: /proc/self/status VmHWM; elsewhere getrusage's ru_maxrss, which
    no reset reaches)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Start the peak afresh at the resident set size now (Linux >= 4.0: writing 5 to
    /proc/self/clear_refs resets VmHWM); False where it cannot.

    Why: a run's memory figures (metrics.jsonl's peak, the memory plan's comparison)
    should be that run's, also when a process runs several (a notebook, a sweep in one
    process): otherwise a bigger earlier run's peak stands for every later one."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def current_rss_bytes() -> int:
    """Resident set size now (/proc/self/statm), or the peak where /proc is absent."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()
    return resident * os.sysconf("SC_PAGE_SIZE")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < UNLIMITED else None


def cgroup_memory_limit(
    proc_cgroup: str | None = None, root: str | Path = "/sys/fs/cgroup"
) -> tuple[int, str] | None:
    """(bytes, cgroup path) of the tightest memory limit on this process's cgroup and its
    ancestors (a parent's limit binds its children), cgroup v2 or v1; None when unlimited.

    The path names the group, so ranks that share one group (one SLURM step on a node)
    can divide its limit between them.
    """
    root = Path(root)
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    best: tuple[int, str] | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2 (unified)
            base, files = root, ("memory.max",)
            if not (root / "cgroup.controllers").exists() and (root / "unified").is_dir():
                base = root / "unified"  # hybrid layout: v2 mounted beside v1
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        else:
            continue
        rel_path = Path(rel.strip().lstrip("/"))
        for ancestor in [rel_path, *rel_path.parents]:
            for name in files:
                limit = _read_limit(base / ancestor / name)
                if limit is not None and (best is None or limit < best[0]):
                    best = (limit, f"cgroup {base / ancestor / name}")
    return best


def slurm_memory_limit(env: dict[str, str], ranks_on_node: int) -> tuple[int, str] | None:
    """What SLURM granted this rank: `--mem-per-cpu` x cpus per task, or `--mem` / ranks
    on the node (SLURM's variables are in MiB)."""
    per_cpu = env.get("SLURM_MEM_PER_CPU")
    if per_cpu and per_cpu.isdigit():
        cpus = env.get("SLURM_CPUS_PER_TASK", "1")
        cpus = int(cpus) if cpus.isdigit() else 1
        return int(per_cpu) * cpus << 20, f"SLURM_MEM_PER_CPU={per_cpu} x {cpus} cpus per task"
    per_node = env.get("SLURM_MEM_PER_NODE")
    if per_node and per_node.isdigit() and int(per_node) > 0:
        return (
            (int(per_node) << 20) // max(1, ranks_on_node),
            f"SLURM_MEM_PER_NODE={per_node} / {ranks_on_node} ranks on the node",
        )
    return None


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def rank_memory_limit(node_comm, env: dict[str, str] | None = None) -> tuple[int, str] | None:
    """(bytes, where it comes from) this rank may hold, or None when nothing limits it.

    A cgroup's limit is shared by the ranks of this node inside it, so it is divided by
    their number (one small allgather over the node's ranks: its cost grows with ranks per
    node, never with the job, so it is the same at 4,096 ranks as at 4).
    """
    env = dict(os.environ) if env is None else env
    found = cgroup_memory_limit()
    paths = node_comm.allgather_object(
        None if found is None else found[1], what="compare memory cgroups on the node"
    )
    candidates = []
    if found is not None:
        sharing = sum(1 for p in paths if p == found[1])
        where = found[1] + (f" / {sharing} ranks in it" if sharing > 1 else "")
        candidates.append((found[0] // sharing, where))
    slurm = slurm_memory_limit(env, node_comm.size)
    if slurm is not None:
        candidates.append(slurm)
    return min(candidates) if candidates else None
