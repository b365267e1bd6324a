"""What an emulated cluster of N nodes consists of: names, addresses, links, arguments.

Pure data, no system calls, so every name and argument can be unit-tested without root.
A node is a network namespace named like its hostname (PREFIX1, PREFIX2, ...; hpcn1,
hpcn2, ... by default), joined to one Linux bridge (hpcbr0 by default) by a veth pair
(`PREFIXK-veth` on the host side, `eth0` inside). Addresses come from one /24 the
emulation owns (10.213.0.0/24 unless told otherwise): the bridge is .1, node K is
.(10+K). The names and the subnet are chosen per cluster (`up --bridge --prefix
--subnet`) and recorded in its state file; `up` refuses names that already exist.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .errors import ClusterError

DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_PREFIX = "hpcn"
DEFAULT_BRIDGE = "hpcbr0"
VETH_SUFFIX = "-veth"
IFNAMSIZ = 15  # the longest Linux interface name
# A node name is PREFIX + number: a hostname label that ends in a letter or '-' so that
# PREFIX + K cannot be read as another prefix's node (hpcn1 + 1 is not hpcn + 11).
_PREFIX_RE = re.compile(r"^[a-z](?:[a-z0-9-]*[a-z-])?$")
_BRIDGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
HOSTS_TAG = "# hpctrain-cluster"
MAX_NODES = 200  # .11 .. .210 of the /24
FIRST_HOST = 10
NAMED_LINKS = ("1gbit", "10gbit", "25gbit", "none")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(mbit|gbit)$")
# Open MPI notices a silent node within ~5 s (idle TCP keepalive) instead of its
# default 300 s + 9 x 20 s: the time a vanished node costs a job.
OOB_KEEPALIVE = {"oob_tcp_keepalive_time": 2, "oob_tcp_keepalive_intvl": 1}
OOB_KEEPALIVE_PROBES = 3
# Inside each node's namespace: give up on a TCP peer that stopped acknowledging after
# ~6 s (4 retransmissions) instead of Linux's ~15 minutes (15), so that mpirun, whose
# abort message to a vanished node is never acknowledged, ends instead of waiting.
NODE_SYSCTLS = {"net.ipv4.tcp_retries2": "4"}


def link_rate(link: str) -> float | None:
    """Bits per second of a link name ('1gbit', '2.5gbit', '100mbit'), None for 'none'."""
    text = str(link).strip().lower()
    if text == "none":
        return None
    m = _RATE_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ClusterError(
            f"--link {link!r} is not a link speed: use one of {', '.join(NAMED_LINKS)} "
            "(or any <number>mbit / <number>gbit)"
        )
    return float(m.group(1)) * (1e6 if m.group(2) == "mbit" else 1e9)


def tbf_args(rate_bps: float) -> list[str]:
    """`tc qdisc replace ... root` arguments of a token bucket shaping to `rate_bps`.

    The bucket (burst) is 256 KiB or 100 µs at line rate, whichever is larger: big
    enough for 64 KiB GSO packets and timer slack, small next to the megabytes of a
    gradient, so a burst cannot pass a large message at more than the rate. `latency`
    bounds the queue (packets waiting longer are dropped, as on a real switch port).
    """
    burst = max(256 * 1024, int(rate_bps / 8 * 1e-4))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "20ms"]


def node_cores(cpus: list[int], nodes: int) -> list[list[int]]:
    """Each node's cores: an even share of `cpus` (a spare remainder stays unused), or,
    with fewer cores than nodes, one core each, shared round robin."""
    cpus = sorted(cpus)
    if not cpus:
        raise ClusterError("no cores to share among the nodes")
    if len(cpus) >= nodes:
        per = len(cpus) // nodes
        return [cpus[i * per : (i + 1) * per] for i in range(nodes)]
    return [[cpus[i % len(cpus)]] for i in range(nodes)]


@dataclass(frozen=True)
class Node:
    name: str  # namespace name = hostname
    address: str  # inside the namespace, on eth0
    veth: str  # host-side end of its link (the other end is eth0 inside)


def check_bridge_name(name: str) -> str:
    """`name` if Linux accepts it as an interface name, else a ClusterError."""
    if not _BRIDGE_RE.match(name) or len(name) > IFNAMSIZ:
        raise ClusterError(
            f"--bridge {name!r} is not an interface name: up to {IFNAMSIZ} letters, digits "
            "and _.- starting with a letter or digit (e.g. hpcbr1)"
        )
    return name


def check_prefix(prefix: str, nodes: int) -> str:
    """`prefix` if PREFIX<n> is a hostname and PREFIX<n>-veth an interface name."""
    longest = f"{prefix}{nodes}{VETH_SUFFIX}"
    if not _PREFIX_RE.match(prefix) or len(longest) > IFNAMSIZ:
        raise ClusterError(
            f"--prefix {prefix!r} cannot name {nodes} node(s): lowercase letters, digits "
            f"and '-', starting with a letter and ending in a letter or '-', short enough "
            f"that {longest!r} fits {IFNAMSIZ} characters (e.g. hpcn, tn)"
        )
    return prefix


@dataclass(frozen=True)
class Plan:
    """N nodes on one bridge in `subnet`, every link shaped to `link`; the bridge is
    called `bridge`, the nodes `prefix`1..N."""

    nodes: int
    link: str = "none"
    subnet: str = DEFAULT_SUBNET
    bridge: str = DEFAULT_BRIDGE
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self):
        if not 1 <= int(self.nodes) <= MAX_NODES:
            raise ClusterError(f"--nodes must be between 1 and {MAX_NODES}, got {self.nodes}")
        link_rate(self.link)
        net = self.network
        if net.version != 4 or net.prefixlen > 24:
            raise ClusterError(f"--subnet {self.subnet} must be an IPv4 network of /24 or larger")
        check_bridge_name(self.bridge)
        check_prefix(self.prefix, int(self.nodes))
        if re.fullmatch(rf"{re.escape(self.prefix)}\d+(?:{VETH_SUFFIX})?", self.bridge):
            raise ClusterError(
                f"--bridge {self.bridge!r} is named like a node or its link (--prefix "
                f"{self.prefix}): pick another bridge name"
            )

    @property
    def network(self) -> ipaddress.IPv4Network:
        try:
            return ipaddress.ip_network(self.subnet, strict=True)
        except ValueError as exc:
            raise ClusterError(f"--subnet {self.subnet!r} is not a network: {exc}") from None

    @property
    def rate_bps(self) -> float | None:
        return link_rate(self.link)

    @property
    def bridge_address(self) -> str:
        return f"{self.network.network_address + 1}/{self.network.prefixlen}"

    def node_list(self) -> list[Node]:
        base = self.network.network_address
        return [
            Node(
                f"{self.prefix}{k}",
                f"{base + FIRST_HOST + k}/{self.network.prefixlen}",
                f"{self.prefix}{k}{VETH_SUFFIX}",
            )
            for k in range(1, int(self.nodes) + 1)
        ]

    def hosts_lines(self) -> list[str]:
        """/etc/hosts entries, each tagged (and listed in the state) so that `down`
        removes exactly these."""
        return [f"{n.address.split('/')[0]} {n.name} {HOSTS_TAG}" for n in self.node_list()]

    def hostfile_text(self, per_node: int = 1) -> str:
        return "".join(f"{n.name} slots={per_node}\n" for n in self.node_list())


def mpirun_args(plan: Plan, agent: str, per_node: int = 1) -> list[str]:
    """Open MPI arguments that place `per_node` ranks on each node of the emulation.

    The rsh agent starts Open MPI's daemon inside each node's namespace; TCP (between
    nodes) and shared memory (within one) are the transports, and Open MPI's own
    traffic is confined to the cluster's subnet so no other interface is tried.
    """
    if per_node < 1:
        raise ClusterError(f"--per-node must be at least 1, got {per_node}")
    hosts = ",".join(f"{n.name}:{per_node}" for n in plan.node_list())
    args = ["--mca", "plm_rsh_agent", agent, "--host", hosts]
    args += ["--mca", "btl", "self,vader,tcp"]
    args += ["--mca", "btl_tcp_if_include", plan.subnet]
    args += ["--mca", "oob_tcp_if_include", plan.subnet]
    for key, value in OOB_KEEPALIVE.items():
        args += ["--mca", key, str(value)]
    args += ["--mca", "oob_tcp_keepalive_probes", str(OOB_KEEPALIVE_PROBES)]
    return args
