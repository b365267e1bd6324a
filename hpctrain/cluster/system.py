"""The system calls of the emulation: commands with deadlines, privileges, /etc/hosts.

Every command runs with a timeout and, on failure, becomes one ClusterError line that
quotes the command and the tool's own complaint.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from .errors import ClusterError, ClusterUnavailable

HOSTS = Path("/etc/hosts")
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "setpriv": "util-linux",
    "hostname": "hostname",
}
# Bits of /proc/self/status CapEff (linux/capability.h).
CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def run(argv: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` (no shell), output captured; a failure raises ClusterError."""
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise ClusterUnavailable(f"{argv[0]} is not installed") from None
    if check and proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(
            f"`{shlex.join(argv)}` failed (exit {proc.returncode})"
            + (f": {said[-1]}" if said else "")
        )
    return proc


def run_json(argv: list[str]) -> list:
    out = run(argv).stdout.strip()
    return json.loads(out) if out else []


def missing_capabilities() -> list[str]:
    """The capabilities the emulation needs that this process lacks (root has them)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                eff = int(line.split()[1], 16)
                return [name for name, bit in CAPABILITIES.items() if not eff >> bit & 1]
    except (OSError, ValueError):
        pass
    return [] if os.geteuid() == 0 else list(CAPABILITIES)


def missing_tools() -> list[str]:
    return [f"{tool} ({pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]


def require_privileges() -> None:
    """Raise ClusterUnavailable naming what is missing to make namespaces here."""
    caps = missing_capabilities()
    if caps:
        raise ClusterUnavailable(
            f"the emulated cluster needs root: this process lacks {' and '.join(caps)} "
            "(network namespaces, veth links and tc shaping need CAP_NET_ADMIN; "
            "`ip netns` and per-node hostnames need CAP_SYS_ADMIN)"
        )
    tools = missing_tools()
    if tools:
        raise ClusterUnavailable(f"the emulated cluster needs {', '.join(tools)}: not found")


def _rewrite_hosts(keep, add: list[str], path: Path) -> None:
    """Rewrite the hosts file in place (same inode: it is often a bind mount)."""
    with open(path, "r+") as f:
        lines = [line for line in f.read().splitlines() if keep(line)]
        f.seek(0)
        f.write("\n".join(lines + add) + "\n")
        f.truncate()


def add_hosts_lines(lines: list[str], tag: str, path: Path = HOSTS) -> None:
    """Append `lines` (each ending in `tag`), replacing earlier copies of the same lines;
    any other line, tagged or not, is left as it is."""
    wanted = {line.rstrip() for line in lines}
    for line in lines:
        if not line.rstrip().endswith(tag):
            raise ClusterError(f"internal: hosts line {line!r} lacks the tag {tag!r}")
    _rewrite_hosts(lambda line: line.rstrip() not in wanted, lines, path)


def remove_hosts_lines(tag: str, path: Path = HOSTS, lines: list[str] | None = None) -> int:
    """Remove the lines ending in `tag` (only those of `lines`, when given); how many."""
    try:
        before = path.read_text().splitlines()
    except OSError:
        return 0
    listed = None if lines is None else {line.rstrip() for line in lines}

    def ours(line: str) -> bool:
        text = line.rstrip()
        return text.endswith(tag) and (listed is None or text in listed)

    count = sum(1 for line in before if ours(line))
    if count:
        _rewrite_hosts(lambda line: not ours(line), [], path)
    return count


def tagged_hosts_lines(tag: str, path: Path = HOSTS, lines: list[str] | None = None) -> list[str]:
    """The lines ending in `tag` (only those of `lines`, when given)."""
    listed = None if lines is None else {line.rstrip() for line in lines}
    try:
        text = path.read_text().splitlines()
    except OSError:
        return []
    return [
        x for x in text if x.rstrip().endswith(tag) and (listed is None or x.rstrip() in listed)
    ]


def hosts_names(path: Path = HOSTS) -> dict[str, str]:
    """{hostname: the /etc/hosts line naming it} for every name the file maps."""
    names: dict[str, str] = {}
    try:
        text = path.read_text().splitlines()
    except OSError:
        return names
    for line in text:
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            names.setdefault(name, line.strip())
    return names
