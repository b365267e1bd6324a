"""Bring the emulated cluster up and down: namespaces, bridge, veth links, shaping.

The cluster's names (bridge, node prefix) and subnet are chosen per cluster and kept in
its state file. `up` refuses names that already exist on the machine (whoever made
them), and records each object in the state file *before* creating it, so a run killed
half-way still leaves a complete list for `down`; a creation that fails (the name was
taken meanwhile) is taken off the list again. `down` removes exactly what the state
lists (namespaces, veth links, the bridge, its own /etc/hosts lines, the cpuset mount
under the state directory), after ending the processes still running inside its
namespaces, and nothing else: an object that merely carries a similar name is never
touched.

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
    DEFAULT_BRIDGE,
    DEFAULT_PREFIX,
    HOSTS_TAG,
    NODE_SYSCTLS,
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
    return Plan(
        len(state["nodes"]),
        state["link"],
        state["subnet"],
        state.get("bridge", DEFAULT_BRIDGE),
        state.get("prefix", DEFAULT_PREFIX),
    )


# --- what exists, and what is ours -------------------------------------------------------
def namespaces() -> list[str]:
    """Every network namespace of this machine (`ip netns list`), whoever made it."""
    return [ns["name"] for ns in system.run_json(["ip", "-j", "netns", "list"])]


def links() -> list[str]:
    """Every network interface of this machine's own namespace, whoever made it."""
    return [x["ifname"] for x in system.run_json(["ip", "-j", "link", "show"])]


def listed(state: dict | None) -> dict[str, list[str]]:
    """What `state` says this cluster made: {"bridge", "namespace", "link": [names],
    "hosts": [/etc/hosts lines]}. Nothing else is ever removed."""
    out: dict[str, list[str]] = {"bridge": [], "namespace": [], "link": [], "hosts": []}
    if not state:
        return out
    made = state.get("made")
    if made is None:  # a state file of an earlier version: what it planned was made
        made = [{"kind": "bridge", "name": state["bridge"]}] if state.get("bridge") else []
        made += [{"kind": "namespace", "name": n} for n in state.get("nodes", [])]
        made += [{"kind": "link", "name": v} for v in state.get("veths", {}).values()]
        hosts = [f"{a} {n} {HOSTS_TAG}" for n, a in state.get("addresses", {}).items()]
    else:
        hosts = list(state.get("hosts_lines", []))
    for item in made:
        out[item["kind"]].append(item["name"])
    out["hosts"] = hosts
    return out


CLUSTER_FILES = ("rsh-agent", "hostfile")  # what `up` writes beside its state file


def leftovers(state_dir: Path = STATE_DIR, state: dict | None = None) -> list[str]:
    """What of this state directory's cluster exists now, described for a message: the
    objects its state lists, its cpuset mount, its state file."""
    state_dir = Path(state_dir)
    state = state if state is not None else read_state(state_dir)
    mine = listed(state)
    found: list[str] = []
    if mine["namespace"]:
        spaces = set(namespaces())
        found += [f"namespace {n}" for n in mine["namespace"] if n in spaces]
    if mine["link"] or mine["bridge"]:
        live = set(links())
        found += [f"link {x}" for x in mine["link"] if x in live]
        found += [f"bridge {x}" for x in mine["bridge"] if x in live]
    mount = cores.leftover(state_dir)
    if mount:
        found.append(mount)
    hosts = system.tagged_hosts_lines(HOSTS_TAG, lines=mine["hosts"]) if mine["hosts"] else []
    if hosts:
        found.append(f"{len(hosts)} line(s) of {system.HOSTS}")
    if state_path(state_dir).exists():
        found.append(f"state {state_path(state_dir)}")
    return found


def check_names_free(plan: Plan) -> None:
    """Refuse, in one line, names of `plan` that something on this machine already has.

    Whatever holds them was not made by this cluster (`up` runs only when no state of
    this cluster exists), so the message names the object and how to choose other names,
    and never suggests removing it."""
    live = set(links())
    if plan.bridge in live:
        raise ClusterError(
            f"--bridge {plan.bridge}: a network interface {plan.bridge} already exists on "
            "this machine and is not this cluster's: pick another bridge name with "
            "--bridge NAME"
        )
    spaces = set(namespaces())
    hosts = system.hosts_names()
    for node in plan.node_list():
        what = None
        if node.name in spaces:
            what = f"a network namespace {node.name} already exists on this machine"
        elif node.veth in live:
            what = f"a network interface {node.veth} already exists on this machine"
        elif node.name in hosts:
            what = f"{system.HOSTS} already names {node.name} ({hosts[node.name]!r})"
        if what:
            raise ClusterError(
                f"--prefix {plan.prefix}: {what} and is not this cluster's: pick another "
                "node name prefix with --prefix NAME"
            )


def check_subnet_free(plan: Plan) -> None:
    """Refuse a subnet that any interface or route of this machine already uses."""
    net = plan.network
    for entry in system.run_json(["ip", "-j", "-4", "addr", "show"]):
        for addr in entry.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{addr['local']}/{addr['prefixlen']}")
            if iface.network.overlaps(net):
                raise ClusterError(
                    f"--subnet {net} is in use: {entry['ifname']} has {iface}; "
                    "pick a free range with --subnet"
                )
    for route in system.run_json(["ip", "-j", "-4", "route", "show", "table", "all"]):
        dst = route.get("dst", "")
        if dst in ("default", "") or route.get("type") in ("local", "broadcast"):
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
def _make(state: dict, state_dir: Path, kind: str, name: str, argv: list[str]) -> None:
    """Create one object with `argv`, listed in the state before it exists; a creation
    that fails (e.g. the name was taken meanwhile) is taken off the list again, so that
    `down` cannot remove what someone else made."""
    state["made"].append({"kind": kind, "name": name})
    _write_state(state, state_dir)
    try:
        system.run(argv)
    except BaseException:
        state["made"].pop()
        _write_state(state, state_dir)
        raise


def up(plan: Plan, owner: str, state_dir: Path = STATE_DIR) -> dict:
    """Create the cluster `plan` describes; on any failure remove what was made."""
    system.require_privileges()
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = leftovers(state_dir)
    if existing:
        raise ClusterError(
            f"an emulated cluster of {state_dir} is already up (" + ", ".join(existing) + "): "
            "`hpctrain cluster down` removes it (for a second cluster beside it, set "
            "HPCTRAIN_CLUSTER_DIR and choose other --bridge, --prefix and --subnet)"
        )
    theirs = [n for n in CLUSTER_FILES if (state_dir / n).exists()]
    if theirs:  # no state lists them (checked above): not this tool's to overwrite
        raise ClusterError(
            f"{state_dir} holds {', '.join(theirs)} that no cluster state lists: point "
            "HPCTRAIN_CLUSTER_DIR at a directory of the cluster's own"
        )
    check_names_free(plan)
    check_subnet_free(plan)
    nodes = plan.node_list()
    state = {
        "owner": owner,
        "owner_pid": os.getpid(),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "subnet": plan.subnet,
        "link": plan.link,
        "bridge": plan.bridge,
        "prefix": plan.prefix,
        "bridge_address": plan.bridge_address,
        "nodes": [n.name for n in nodes],
        "addresses": {n.name: n.address.split("/")[0] for n in nodes},
        "veths": {n.name: n.veth for n in nodes},
        "agent": str(state_dir / "rsh-agent"),
        "hostfile": str(state_dir / "hostfile"),
        "made": [],  # what exists because of this cluster: all that `down` removes
        "hosts_lines": [],
        "complete": False,
    }
    _write_state(state, state_dir)
    try:
        run = system.run
        bridge = plan.bridge
        _make(state, state_dir, "bridge", bridge, ["ip", "link", "add", bridge, "type", "bridge"])
        run(["ip", "addr", "add", plan.bridge_address, "dev", bridge])
        run(["ip", "link", "set", bridge, "up"])
        for n in nodes:
            _make(state, state_dir, "namespace", n.name, ["ip", "netns", "add", n.name])
            veth = ["ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0"]
            _make(state, state_dir, "link", n.veth, [*veth, "netns", n.name])
            run(["ip", "link", "set", n.veth, "master", bridge, "up"])
            run(["ip", "-n", n.name, "addr", "add", n.address, "dev", "eth0"])
            run(["ip", "-n", n.name, "link", "set", "lo", "up"])
            run(["ip", "-n", n.name, "link", "set", "eth0", "up"])
            for key, value in NODE_SYSCTLS.items():
                run(["ip", "netns", "exec", n.name, "sysctl", "-q", "-w", f"{key}={value}"])
        shape(plan.link, state_dir=state_dir, state=state)
        state["cpuset_group"] = cores.group_name(plan.bridge)
        _write_state(state, state_dir)
        try:
            state["cores"] = cores.create(state_dir, state["nodes"], state["cpuset_group"])
        except (ClusterError, OSError) as exc:  # the nodes share the cores; status says why
            state["cores"], state["cores_unavailable"] = None, str(exc)
            cores.remove(state_dir, state["cpuset_group"])
        state["hosts_lines"] = plan.hosts_lines()
        _write_state(state, state_dir)
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
    spaces = set(namespaces()) if state else set()
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
    """Remove what this state directory's cluster made, as its state file lists it (and
    nothing else); what was removed, for the log. The state file goes last, once all
    it lists is gone, so a failed `down` can be run again."""
    state_dir = Path(state_dir)
    state = read_state(state_dir)
    mine = listed(state)
    removed: list[str] = []
    live_spaces = set(namespaces()) if mine["namespace"] else set()
    spaces = [n for n in mine["namespace"] if n in live_spaces]
    stuck = _end_processes(spaces)
    if stuck:
        removed.append(f"processes {stuck} would not end")
    # A state of an earlier version used one group name for every cluster.
    group = state.get("cpuset_group", cores.GROUP) if state else None
    removed += cores.remove(state_dir, group)
    live = set(links()) if mine["link"] or mine["bridge"] else set()
    for link in [x for x in mine["link"] if x in live]:
        # Deleting one end deletes the pair; done before the namespace, whose removal
        # the kernel finishes asynchronously.
        system.run(["ip", "link", "del", link], check=False)
        removed.append(f"link {link}")
    for ns in spaces:
        system.run(["ip", "netns", "del", ns], check=False)
        removed.append(f"namespace {ns}")
    for bridge in [x for x in mine["bridge"] if x in live]:
        system.run(["ip", "link", "del", bridge], check=False)
        removed.append(f"bridge {bridge}")
    if mine["hosts"]:
        n = system.remove_hosts_lines(HOSTS_TAG, lines=mine["hosts"])
        if n:
            removed.append(f"{n} line(s) of {system.HOSTS}")
    left = [x for x in leftovers(state_dir, state) if not x.startswith("state ")]
    if left:
        raise ClusterError("could not remove " + ", ".join(left))
    # the files `up` wrote, as its state names them: a user's file merely called like
    # them (HPCTRAIN_CLUSTER_DIR pointed at a shared directory) stays
    files = [state.get("agent"), state.get("hostfile"), str(state_path(state_dir))] if state else []
    for path in [Path(f) for f in files if f]:
        if path.exists():
            path.unlink()
            removed.append(str(path))
    return removed
