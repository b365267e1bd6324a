"""Hosts of an elastic job: the hostfile, and which hosts still answer.

A host counts as lost when the launch node cannot reach it over TCP (the probe port
answers, or refuses: either way a live kernel; silence or no route: lost) or, with an
rsh agent, when `agent HOST true` fails or times out. Probes run in parallel, up to
PROBE_THREADS at once, and send nothing to any rank. A live host answers in about a
millisecond; a lost one costs the timeout. So a restart decision at 1,024 or 4,096 hosts
takes one timeout (5 s by default) while at most 256 hosts are lost, and one more timeout
for each further 256 lost. The supervisor's watch of a running attempt (TCP only, every
30 s by default) costs the launch node 1,024 or 4,096 connections per interval, about
4 or 16 rounds of 256 one-millisecond answers: well under a second, and nothing on the
ranks' nodes but a kernel's SYN-ACK.
"""

from __future__ import annotations

import errno
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

PROBE_THREADS = 256


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str | Path) -> list[Host]:
    """Open MPI's hostfile format: `name [slots=N] ...` per line, `#` comments."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--hostfile {path}: not a text file (not UTF-8)") from None
    hosts: list[Host] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(f"{path}:{number}: slots must be a positive integer")
                slots = int(value)
        if words[0] in seen:
            raise ConfigError(f"{path}:{number}: host {words[0]} is listed twice")
        seen.add(words[0])
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise ConfigError(f"--hostfile {path}: no hosts in it")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ("2(x3),1") as one count per node ([2, 2, 2, 1])."""
    counts = []
    for part in text.split(","):
        number, _, repeat = part.partition("(x")
        try:
            counts += [int(number)] * (int(repeat.rstrip(")")) if repeat else 1)
        except ValueError:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={text!r}: cannot read it") from None
    return counts


def allocation_hosts(env: dict) -> list[Host]:
    """The nodes of the SLURM allocation this runs in, with their task counts as slots.

    `scontrol show hostnames` expands the node list (`node[01-04]`); one call, whatever
    the number of nodes.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(
            "--launcher srun runs inside an allocation (sbatch or salloc): "
            "SLURM_JOB_NODELIST is not set"
        )
    try:
        done = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot expand SLURM_JOB_NODELIST with scontrol: {exc}") from None
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        raise ConfigError(f"scontrol show hostnames {nodelist}: {done.stderr.strip()}")
    tasks = env.get("SLURM_TASKS_PER_NODE")
    counts = expand_tasks_per_node(tasks) if tasks else [1] * len(names)
    if len(counts) != len(names):
        raise ConfigError(
            f"SLURM_TASKS_PER_NODE={tasks!r} does not match the {len(names)} nodes of {nodelist}"
        )
    return [Host(n, c) for n, c in zip(names, counts, strict=True)]


def write_hostfile(path: Path, hosts: list[Host]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{h.name} slots={h.slots}\n" for h in hosts))
    return path


def tcp_problem(host: str, port: int, timeout: float) -> str | None:
    """None when `host`'s kernel answers on `port` (accepts or refuses), else why not."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"name does not resolve ({exc.strerror})"
    family, kind, proto, _, address = addresses[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout)
        try:
            s.connect(address)
        except ConnectionRefusedError:
            return None  # a live kernel said no: the host is up
        except TimeoutError:
            return f"no answer on TCP port {port} within {timeout:g} s"
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return None
            return f"TCP port {port}: {exc.strerror}"
    return None


def agent_problem(agent: list[str], host: str, timeout: float) -> str | None:
    """None when `agent HOST true` succeeds within `timeout` (the launcher's own path)."""
    try:
        done = subprocess.run(
            [*agent, host, "true"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"`{' '.join(agent)} {host} true` did not return within {timeout:g} s"
    except OSError as exc:
        return f"cannot run the rsh agent {agent[0]}: {exc.strerror}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"`{' '.join(agent)} {host} true` failed ({said[-1] if said else done.returncode})"
    return None


def is_this_host(name: str) -> bool:
    """The launch node itself (the supervisor runs there, so it is alive)."""
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False
    return address.startswith("127.")


def probe(hosts: list[Host], port: int, timeout: float, agent: list[str] | None) -> dict:
    """{host name: None (alive) or the reason it is lost}, all probed at once."""
    if not hosts:
        return {}

    def one(host: Host) -> str | None:
        if is_this_host(host.name):
            return None
        problem = tcp_problem(host.name, port, timeout)
        if problem is None and agent:
            problem = agent_problem(agent, host.name, timeout)
        return problem

    with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(hosts))) as pool:
        return dict(zip((h.name for h in hosts), pool.map(one, hosts), strict=True))
