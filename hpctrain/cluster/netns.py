"""Bring the emulated cluster up and down: namespaces, bridge, veth links, shaping.

`up` writes the state file (what it is about to create) before creating anything, so a
run killed half-way still leaves a complete list for `down`. `down` removes what the
state lists plus anything else carrying the emulation's names (hpcnK namespaces,
hpcnK-veth links, the hpcbr0 bridge, tagged /etc/hosts lines), after ending the
processes still running inside its namespaces, and nothing else.

Cost grows with nodes, not ranks: about 12 commands per node (~10 ms each), so 2 nodes
take well under a second. 1,024 or 4,096 ranks cannot be emulated on one machine (the
plan stops at 200 nodes, a /24); at 200 nodes `up` runs ~2,400 commands (~30 s).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

from . import cores, system
from .agent import write_agent
from .errors import ClusterError
from .plan import (
    BRIDGE,
    HOSTS_TAG,
    NODE_NAME_RE,
    NODE_SYSCTLS,
    VETH_SUFFIX,
    Plan,
    link_rate,
    tbf_args,
)

STATE_DIR = Path(os.environ.get("HPCTRAIN_CLUSTER_DIR", "/run/hpctrain-cluster"))


def state_path(state_dir: Path = STATE_DIR) -> Path:
    return Path(state_dir) / "state.json"


def read_state(state_dir: Path = STATE_DIR) -> dict | None:
    try:
        return json.loads(state_path(state_dir).read_text())
    except (OSError, ValueError):
        return None


def _write_state(state: dict, state_dir: Path) -> None:
    path = state_path(state_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def plan_of(state: dict) -> Plan:
    return Plan(len(state["nodes"]), state["link"], state["subnet"])


# --- what exists --------------------------------------------------------------------
def our_namespaces() -> list[str]:
    names = [ns["name"] for ns in system.run_json(["ip", "-j", "netns", "list"])]
    return sorted((n for n in names if NODE_NAME_RE.match(n)), key=_node_index)


def our_links() -> list[str]:
    links = [x["ifname"] for x in system.run_json(["ip", "-j", "link", "show"])]
    return [
        x
        for x in links
        if x == BRIDGE or (x.endswith(VETH_SUFFIX) and NODE_NAME_RE.match(x[: -len(VETH_SUFFIX)]))
    ]


def _node_index(name: str) -> int:
    m = NODE_NAME_RE.match(name)
    return int(m.group(1)) if m else 0


def leftovers(state_dir: Path = STATE_DIR) -> list[str]:
    """Everything of an emulated cluster that exists now, described for a message."""
    found = [f"namespace {n}" for n in our_namespaces()]
    found += [f"link {x}" for x in our_links()]
    mount = cores.leftover(state_dir)
    if mount:
        found.append(mount)
    hosts = system.tagged_hosts_lines(HOSTS_TAG)
    if hosts:
        found.append(f"{len(hosts)} line(s) of {system.HOSTS}")
    if state_path(state_dir).exists():
        found.append(f"state {state_path(state_dir)}")
    return found


def check_subnet_free(plan: Plan) -> None:
    """Refuse a subnet that any interface or route of this machine already uses."""
    net = plan.network
    for entry in system.run_json(["ip", "-j", "-4", "addr", "show"]):
        for addr in entry.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{addr['local']}/{addr['prefixlen']}")
            if iface.network.overlaps(net) and entry["ifname"] != BRIDGE:
                raise ClusterError(
                    f"--subnet {net} is in use: {entry['ifname']} has {iface}; "
                    "pick a free range with --subnet"
                )
    for route in system.run_json(["ip", "-j", "-4", "route", "show", "table", "all"]):
        dst = route.get("dst", "")
        if (
            dst in ("default", "")
            or route.get("dev") == BRIDGE
            or route.get("type")
            in (
                "local",
                "broadcast",
            )
        ):
            continue
        try:
            routed = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if routed.overlaps(net):
            raise ClusterError(
                f"--subnet {net} is in use: a route to {routed} via {route.get('dev', '?')} "
                "exists; pick a free range with --subnet"
            )


# --- up -------------------------------------------------------------------------------
def up(plan: Plan, owner: str, state_dir: Path = STATE_DIR) -> dict:
    """Create the cluster `plan` describes; on any failure remove what was made."""
    system.require_privileges()
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = leftovers(state_dir)
    if existing:
        raise ClusterError(
            "an emulated cluster is already up (" + ", ".join(existing) + "): run "
            "`hpctrain cluster down` first"
        )
    check_subnet_free(plan)
    nodes = plan.node_list()
    state = {
        "owner": owner,
        "owner_pid": os.getpid(),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "subnet": plan.subnet,
        "link": plan.link,
        "bridge": BRIDGE,
        "bridge_address": plan.bridge_address,
        "nodes": [n.name for n in nodes],
        "addresses": {n.name: n.address.split("/")[0] for n in nodes},
        "veths": {n.name: n.veth for n in nodes},
        "agent": str(state_dir / "rsh-agent"),
        "hostfile": str(state_dir / "hostfile"),
        "complete": False,
    }
    _write_state(state, state_dir)
    try:
        run = system.run
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", plan.bridge_address, "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        for n in nodes:
            run(["ip", "netns", "add", n.name])
            run(
                [
                    "ip",
                    "link",
                    "add",
                    n.veth,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    n.name,
                ]
            )
            run(["ip", "link", "set", n.veth, "master", BRIDGE, "up"])
            run(["ip", "-n", n.name, "addr", "add", n.address, "dev", "eth0"])
            run(["ip", "-n", n.name, "link", "set", "lo", "up"])
            run(["ip", "-n", n.name, "link", "set", "eth0", "up"])
            for key, value in NODE_SYSCTLS.items():
                run(["ip", "netns", "exec", n.name, "sysctl", "-q", "-w", f"{key}={value}"])
        shape(plan.link, state_dir=state_dir, state=state)
        try:
            state["cores"] = cores.create(state_dir, state["nodes"])
        except (ClusterError, OSError) as exc:  # the nodes share the cores; status says why
            state["cores"], state["cores_unavailable"] = None, str(exc)
            cores.remove(state_dir)
        system.add_hosts_lines(plan.hosts_lines(), HOSTS_TAG)
        write_agent(Path(state["agent"]), state["nodes"], state["cores"])
        Path(state["hostfile"]).write_text(plan.hostfile_text())
        state["complete"] = True
        _write_state(state, state_dir)
    except BaseException:
        down(state_dir)
        raise
    return state


# --- shaping and link state ------------------------------------------------------------
def _require_state(state_dir: Path) -> dict:
    state = read_state(state_dir)
    if not state:
        raise ClusterError("no emulated cluster is up: run `hpctrain cluster up` first")
    return state


def _node_names(state: dict, node: str | None) -> list[str]:
    if node is None:
        return list(state["nodes"])
    if node not in state["nodes"]:
        raise ClusterError(
            f"--node {node!r} is not a node of the cluster ({', '.join(state['nodes'])})"
        )
    return [node]


def shape(
    link: str, node: str | None = None, state_dir: Path = STATE_DIR, state: dict | None = None
) -> None:
    """Shape both ends of each node's link (a qdisc shapes egress only) to `link`."""
    rate = link_rate(link)
    state = state or _require_state(state_dir)
    for name in _node_names(state, node):
        for prefix, dev in ((["tc"], state["veths"][name]), (["tc", "-n", name], "eth0")):
            if rate is None:
                proc = system.run([*prefix, "qdisc", "del", "dev", dev, "root"], check=False)
                nothing_to_remove = ("No such file", "Cannot delete qdisc with handle of zero")
                if proc.returncode != 0 and not any(t in proc.stderr for t in nothing_to_remove):
                    raise ClusterError(f"removing the shaping of {dev}: {proc.stderr.strip()}")
            else:
                system.run([*prefix, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate)])
    if node is None:
        state["link"] = link
        if state.get("complete"):
            _write_state(state, state_dir)


def set_link(node: str, up_: bool, state_dir: Path = STATE_DIR) -> None:
    """Take a node's link down (unplug its cable) or bring it back up."""
    state = _require_state(state_dir)
    (name,) = _node_names(state, node)
    veth = state["veths"][name]
    system.run(["ip", "link", "set", veth, "up" if up_ else "down"])
    if up_:  # back when the kernel says so: carrier up and the bridge port forwarding
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            (link,) = system.run_json(["ip", "-j", "link", "show", "dev", veth])
            ports = system.run_json(["bridge", "-j", "link", "show", "dev", veth])
            forwarding = all(p.get("state", "forwarding") == "forwarding" for p in ports)
            if link.get("operstate") in ("UP", "UNKNOWN") and forwarding:
                # Addresses probed while the cable was out stay FAILED in the other nodes'
                # neighbour tables for a while ("No route to host"): forget them.
                for other in state["nodes"]:
                    system.run(["ip", "-n", other, "neigh", "flush", "all"])
                return
            time.sleep(0.1)
        raise ClusterError(f"the link of {node} ({veth}) did not come back up within 10 s")


# --- status ----------------------------------------------------------------------------
def _shaped_bps(dev: str) -> float | None:
    """The token-bucket rate on `dev` in bits per second (tc reports bytes per second)."""
    for q in system.run_json(["tc", "-j", "qdisc", "show", "dev", dev]):
        if q.get("root") and q.get("kind") == "tbf":
            return q["options"]["rate"] * 8
    return None


def status(state_dir: Path = STATE_DIR) -> dict:
    """The state file plus what is live now, per node (link up/down, shaping, processes)."""
    state = read_state(state_dir)
    live = {x["ifname"]: x for x in system.run_json(["ip", "-j", "link", "show"])}
    spaces = set(our_namespaces())
    nodes = {}
    for name in (state or {}).get("nodes", []):
        veth = state["veths"][name]
        nodes[name] = {
            "address": state["addresses"][name],
            "namespace": name in spaces,
            "link": "absent"
            if veth not in live
            else ("up" if "UP" in live[veth].get("flags", []) else "down"),
            "shaped_bps": _shaped_bps(veth) if veth in live else None,
            "processes": len(_pids_in(name)) if name in spaces else 0,
            "cores": ((state.get("cores") or {}).get("cores") or {}).get(name),
        }
    return {"state": state, "nodes": nodes, "leftovers": [] if state else leftovers(state_dir)}


# --- down ------------------------------------------------------------------------------
def _pids_in(namespace: str) -> list[int]:
    proc = system.run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _end_processes(namespaces: list[str], grace: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, the processes still running inside our namespaces."""
    pids = [p for ns in namespaces for p in _pids_in(ns)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.1)
        pids = alive
        if not pids:
            break
    return pids


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def down(state_dir: Path = STATE_DIR) -> list[str]:
    """Remove the cluster (whatever of it exists); what was removed, for the log."""
    state_dir = Path(state_dir)
    removed: list[str] = []
    spaces = our_namespaces()
    stuck = _end_processes(spaces)
    if stuck:
        removed.append(f"processes {stuck} would not end")
    removed += cores.remove(state_dir)
    for link in [x for x in our_links() if x != BRIDGE]:
        # Deleting one end deletes the pair; done before the namespace, whose removal
        # the kernel finishes asynchronously.
        system.run(["ip", "link", "del", link], check=False)
        removed.append(f"link {link}")
    for ns in spaces:
        system.run(["ip", "netns", "del", ns], check=False)
        removed.append(f"namespace {ns}")
    if BRIDGE in our_links():
        system.run(["ip", "link", "del", BRIDGE], check=False)
        removed.append(f"bridge {BRIDGE}")
    n = system.remove_hosts_lines(HOSTS_TAG)
    if n:
        removed.append(f"{n} line(s) of {system.HOSTS}")
    for name in ("rsh-agent", "hostfile", "state.json"):
        path = state_dir / name
        if path.exists():
            path.unlink()
            removed.append(str(path))
    left = leftovers(state_dir)
    if left:
        raise ClusterError("could not remove " + ", ".join(left))
    return removed
