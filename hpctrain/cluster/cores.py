"""Each emulated node its own cores: one cpuset cgroup per node.

Why: a namespace isolates the network, not the CPUs. Every node saw all of the machine's
cores, and Open MPI bound the first rank of *each* node to core 0, so two nodes' ranks
shared one core while the other idled (measured 2026-11-26: the benchmark mlp's step
without communication took 22 ms across two nodes, 7.5 ms on one node). A real node owns
its cores; an emulated one now does too. Nodes get an even share of the cores this
process may use; with fewer cores than nodes they share them round robin (`node_cores`).

cgroup v1 (the cpuset hierarchy) or v2 (the cpuset controller). The cgroup file system is
mounted a second time under the state directory, a path the rsh agent (which runs inside
the first node) reaches however the node was entered (`ip netns exec` remounts /sys and
hides /sys/fs/cgroup; the cluster enters nodes with nsenter, agent.py). Where
cpusets cannot be made (a container without them) the nodes share the machine's cores;
`up` keeps the reason and `status` prints it.

A second mount of the cgroup file system shows the machine's one hierarchy, so the
cluster's group is named after its bridge (`hpctrain-cluster-<bridge>`, a name no other
live cluster can have) and `down` removes that group only, as the state file names it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import system
from .errors import ClusterError
from .plan import node_cores

MOUNT_NAME = "cpuset"  # under the state directory
GROUP = "hpctrain-cluster"  # the group of a cluster whose state predates group_name()


def group_name(bridge: str) -> str:
    """The cpuset group of the cluster whose bridge is `bridge`."""
    return f"{GROUP}-{bridge}"


def _mounts() -> list[list[str]]:
    try:
        return [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return []


def cgroup_version() -> int | None:
    """1 when a v1 cpuset hierarchy is mounted, 2 for the unified hierarchy, else None."""
    for fields in _mounts():
        if len(fields) > 3 and fields[2] == "cgroup" and "cpuset" in fields[3].split(","):
            return 1
    if any(len(f) > 2 and f[2] == "cgroup2" for f in _mounts()):
        return 2
    return None


def mounted(mount: Path) -> bool:
    return any(len(f) > 1 and f[1] == str(mount) for f in _mounts())


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise ClusterError(f"writing {value!r} to {path}: {exc.strerror or exc}") from None


def create(state_dir: Path, nodes: list[str], group_name: str = GROUP) -> dict:
    """Mount, make one cpuset group per node; {"dir", "version", "cores": {node: [cpu]}}.

    Raises ClusterError when cpusets cannot be used here; `up` then records the reason
    and goes on without them."""
    version = cgroup_version()
    if version is None:
        raise ClusterError("no cgroup file system with the cpuset controller is mounted")
    mount = Path(state_dir) / MOUNT_NAME
    mount.mkdir(parents=True, exist_ok=True)
    if not mounted(mount):
        if version == 1:
            system.run(["mount", "-t", "cgroup", "-o", "cpuset", "hpctrain-cpuset", str(mount)])
        else:
            system.run(["mount", "-t", "cgroup2", "hpctrain-cgroup2", str(mount)])
    group = mount / group_name
    if version == 2:
        if "cpuset" not in (mount / "cgroup.controllers").read_text().split():
            raise ClusterError("the cgroup2 hierarchy does not offer the cpuset controller")
        _write(mount / "cgroup.subtree_control", "+cpuset")
    group.mkdir(exist_ok=True)
    usable = sorted(os.sched_getaffinity(0))
    if version == 1:  # a v1 cpuset needs its cpus and memory nodes before any child
        _write(group / "cpuset.cpus", ",".join(map(str, usable)))
        _write(group / "cpuset.mems", (mount / "cpuset.mems").read_text().strip())
    else:
        _write(group / "cgroup.subtree_control", "+cpuset")
    shares = node_cores(usable, len(nodes))
    for name, cpus in zip(nodes, shares, strict=True):
        node = group / name
        node.mkdir(exist_ok=True)
        _write(node / "cpuset.cpus", ",".join(map(str, cpus)))
        if version == 1:
            _write(node / "cpuset.mems", (group / "cpuset.mems").read_text().strip())
    return {"dir": str(group), "version": version, "cores": dict(zip(nodes, shares, strict=True))}


def remove(state_dir: Path, group_name: str | None = GROUP) -> list[str]:
    """Remove the cluster's group `group_name` with its node groups, and the mount under
    the state directory (whatever of them exists); what was removed. None: the mount only.

    Processes still in a group (none after `down` ended the nodes' processes) are moved
    back to the root group first, so the removal cannot fail on them."""
    mount = Path(state_dir) / MOUNT_NAME
    removed: list[str] = []
    if not mounted(mount):
        with contextlib.suppress(OSError):
            mount.rmdir()
        return removed
    group = mount / group_name if group_name else None
    if group is not None and group.is_dir():
        for node in sorted(p for p in group.iterdir() if p.is_dir()):
            _evacuate(node, mount)
            with contextlib.suppress(OSError):
                node.rmdir()
        _evacuate(group, mount)
        with contextlib.suppress(OSError):
            group.rmdir()
        removed.append(f"cpusets {group}")
    system.run(["umount", str(mount)], check=False)
    with contextlib.suppress(OSError):
        mount.rmdir()
    return removed


def _evacuate(group: Path, root: Path) -> None:
    try:
        pids = (group / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(pid)


def leftover(state_dir: Path) -> str | None:
    mount = Path(state_dir) / MOUNT_NAME
    return f"cgroup mount {mount}" if mounted(mount) else None
