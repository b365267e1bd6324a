"""`hpctrain cluster up|down|status|link|mpirun-args|run`: the emulated cluster by hand.

None of these start MPI. `up` and `down` take the cluster's lock for their few seconds,
so they refuse (naming the holder) while a test or benchmark session is using it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import netns, system
from .agent import on_node
from .errors import ClusterError
from .plan import DEFAULT_BRIDGE, DEFAULT_PREFIX, DEFAULT_SUBNET, NAMED_LINKS, Plan, mpirun_args
from .session import Lock

EPILOG = """\
example (as root):
  hpctrain cluster up --nodes 2 --link 1gbit
  hpctrain cluster run -- mpirun $(hpctrain cluster mpirun-args --per-node 2) hpctrain doctor
  hpctrain cluster link down --node hpcn2     # unplug a node's cable (and `link up`)
  hpctrain cluster down

`run` starts the command on the first node, as a batch script's mpirun runs on the
first node of its allocation; mpirun then reaches the other nodes through the rsh agent.
`up` refuses names (--bridge, --prefix) or a --subnet that this machine already uses;
`down` removes what `up` listed in its state file (HPCTRAIN_CLUSTER_DIR, default
/run/hpctrain-cluster), and nothing else.
"""


def register(subparsers) -> dict:
    p = subparsers.add_parser(
        "cluster",
        help="an emulated multi-node cluster on this machine (network namespaces; root)",
        description="Nodes as network namespaces with their own hostname and address on one "
        "bridge, links shaped with tc, Open MPI launching across them without ssh.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    s = sub.add_parser("up", help="create the nodes, links and hostfile")
    s.add_argument("--nodes", type=int, default=2, metavar="N", help="nodes (default 2)")
    s.add_argument(
        "--link",
        default="none",
        metavar="SPEED",
        help=f"every node's link: {' | '.join(NAMED_LINKS)}, or any <n>mbit or <n>gbit "
        "(default none: unshaped)",
    )
    s.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"addresses (default {DEFAULT_SUBNET})")
    s.add_argument(
        "--bridge",
        default=DEFAULT_BRIDGE,
        metavar="NAME",
        help=f"the bridge joining the nodes (default {DEFAULT_BRIDGE}); must not exist yet",
    )
    s.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        metavar="NAME",
        help=f"node names are NAME1, NAME2, ... (default {DEFAULT_PREFIX}); namespaces, "
        "hostnames and NAMEk-veth links that must not exist yet",
    )
    s = sub.add_parser(
        "down", help="remove what `up` created (as its state file lists it), and nothing else"
    )
    s.add_argument(
        "--force", action="store_true", help="even while a test or benchmark session holds it"
    )
    sub.add_parser("status", help="nodes, addresses, links and shaping (exit 1 if down)")
    s = sub.add_parser("link", help="reshape the links, or take one down / bring it up")
    s.add_argument(
        "what",
        metavar="SPEED|down|up",
        help=f"{' | '.join(NAMED_LINKS)}, <n>mbit, <n>gbit, down, up",
    )
    s.add_argument("--node", help="only this node's link (required for down/up)")
    s = sub.add_parser("mpirun-args", help="print mpirun's arguments for the cluster")
    s.add_argument("--per-node", type=int, default=1, metavar="K", help="ranks per node")
    s = sub.add_parser("run", help="run a command on a node (default: the first)")
    s.add_argument("--node", help="node name (default: the first node)")
    s.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return {"cluster": run}


def run(args) -> int:
    return {
        "up": _up,
        "down": _down,
        "status": _status,
        "link": _link,
        "mpirun-args": _mpirun_args,
        "run": _run,
    }[args.cluster_command](args)


def _state() -> dict:
    state = netns.read_state()
    if not state:
        raise ClusterError("no emulated cluster is up: run `hpctrain cluster up` first")
    return state


def _up(args) -> int:
    plan = Plan(args.nodes, args.link, args.subnet, args.bridge, args.prefix)
    system.require_privileges()  # before touching /run: say what is missing, once
    lock = Lock()
    lock.acquire(0, "hpctrain cluster up")
    try:
        state = netns.up(plan, owner="cli")
    finally:
        lock.release()
    nodes = ", ".join(f"{n} {state['addresses'][n]}" for n in state["nodes"])
    print(
        f"cluster up: {len(state['nodes'])} node(s) ({nodes}) on bridge {state['bridge']} "
        f"{state['bridge_address']}, links {'unshaped' if plan.link == 'none' else plan.link}"
    )
    print(f"hostfile {state['hostfile']}, rsh agent {state['agent']}")
    print("launch: hpctrain cluster run -- mpirun $(hpctrain cluster mpirun-args) COMMAND")
    return 0


def _down(args) -> int:
    system.require_privileges()
    lock = Lock()
    if not args.force:
        lock.acquire(0, "hpctrain cluster down")
    try:
        removed = netns.down()
    finally:
        lock.release()
    print("cluster down: " + (", ".join(removed) if removed else "nothing to remove"))
    return 0


def _status(args) -> int:
    info = netns.status()
    state = info["state"]
    if not state:
        extra = f" (leftovers: {', '.join(info['leftovers'])})" if info["leftovers"] else ""
        print(f"cluster down{extra}")
        return 1
    print(
        f"cluster up since {state['created_utc']} ({state['owner']}, pid {state['owner_pid']}): "
        f"subnet {state['subnet']}, bridge {state['bridge']} {state['bridge_address']}, "
        f"nodes {state.get('prefix', DEFAULT_PREFIX)}1..{len(state['nodes'])}, "
        f"link {state['link']}"
    )
    width = max([7, *(len(name) for name in info["nodes"])])
    print(f"  {'node':<{width}} address        link  shaped          cores  processes")
    for name, n in info["nodes"].items():
        shaped = f"{n['shaped_bps'] / 1e9:g} Gbit/s" if n["shaped_bps"] else "no"
        own = ",".join(map(str, n["cores"])) if n["cores"] else "all"
        print(
            f"  {name:<{width}} {n['address']:<14} {n['link']:<5} {shaped:<15} {own:<6} "
            f"{n['processes']}"
        )
    if state.get("cores_unavailable"):
        print(f"nodes share the machine's cores: {state['cores_unavailable']}")
    print(f"hostfile {state['hostfile']}, rsh agent {state['agent']}")
    return 0


def _link(args) -> int:
    if args.what in ("down", "up"):
        if not args.node:
            raise ClusterError(f"`hpctrain cluster link {args.what}` needs --node NAME")
        netns.set_link(args.node, args.what == "up")
        print(f"link of {args.node} {args.what}")
    else:
        netns.shape(args.what, node=args.node)
        print(f"link(s) of {args.node or 'every node'} now {args.what}")
    return 0


def _mpirun_args(args) -> int:
    state = _state()
    print(shlex.join(mpirun_args(netns.plan_of(state), state["agent"], args.per_node)))
    return 0


def _run(args) -> int:
    state = _state()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ClusterError("`hpctrain cluster run` needs a command after --")
    node = args.node or state["nodes"][0]
    if node not in state["nodes"]:
        raise ClusterError(f"--node {node!r} is not a node ({', '.join(state['nodes'])})")
    sys.stdout.flush()
    argv = on_node(node, argv, state.get("cores"))
    os.execvp(argv[0], argv)
    return 0  # not reached
