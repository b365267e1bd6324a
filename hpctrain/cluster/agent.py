"""Running a command "on a node": inside its network namespace, under its hostname.

Two users: Open MPI, which starts its daemon on every remote node through an rsh agent
(called like ssh: `AGENT [options] HOST COMMAND...`), and the tests and benchmarks,
which start mpirun itself on the first node, as a batch script's mpirun runs on the
first node of its allocation.
"""

from __future__ import annotations

from pathlib import Path

# Where `ip netns add` keeps a namespace. Entered with nsenter, not `ip netns exec`: that
# one also makes a mount namespace and remounts /sys on every entry, an unmount that
# waits for an RCU grace period (a second job's entry was seen stuck there for over 30 s
# beside a running job; with nsenter that job stalls later all the same, docs/cluster.md).
NETNS_DIR = "/run/netns"

# Called by Open MPI like ssh. The command arrives as words for a remote shell to join
# (ssh semantics); a daemon command alone is exec'ed so that `setpriv --pdeathsig`
# ties it to mpirun: if mpirun dies, no daemon is left behind on the node.
AGENT_TEMPLATE = """\
#!/bin/sh
# Open MPI plm_rsh_agent of the hpctrain emulated cluster, written by `hpctrain cluster up`
# and removed by `hpctrain cluster down`. Usage (like ssh): rsh-agent [options] HOST COMMAND...
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host="$1"
[ $# -ge 1 ] && shift
case " {nodes} " in
  *" $host "*) ;;
  *) echo "hpctrain cluster rsh-agent: '$host' is not a node of the emulated cluster ({nodes})" >&2
     exit 255;;
esac
cmd="$*"
case "$cmd" in *';'*) ;; *) cmd="exec $cmd";; esac
{cores}
exec nsenter --net="{netns_dir}/$host" unshare --uts setpriv --pdeathsig KILL -- \\
    sh -c 'hostname "$0" && eval "$1"' "$host" "$cmd"
"""


# With per-node cpusets (cores.py) the agent joins the node's group before it enters the
# namespace (inside, /sys/fs/cgroup is hidden), and says how many cores the node has.
CORES_TEMPLATE = """\
case "$host" in
{cases}
esac
echo $$ > "{dir}/$host/cgroup.procs" || exit 255
export HPCTRAIN_NODE_CORES="$ncores"
"""


def agent_script(node_names: list[str], cores: dict | None = None) -> str:
    block = ""
    if cores:
        cases = "\n".join(f"  {n}) ncores={len(c)};;" for n, c in cores["cores"].items())
        block = CORES_TEMPLATE.replace("{cases}", cases).replace("{dir}", cores["dir"])
    script = AGENT_TEMPLATE.replace("{nodes}", " ".join(node_names)).replace("{cores}", block)
    return script.replace("{netns_dir}", NETNS_DIR)


def write_agent(path: Path, node_names: list[str], cores: dict | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(agent_script(node_names, cores))
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def on_node(node: str, argv: list[str], cores: dict | None = None) -> list[str]:
    """argv that runs `argv` (no shell involved) on `node` with `node` as hostname, on
    the node's own cores when the cluster has per-node cpusets (`cores`, from the state)."""
    prefix: list[str] = []
    if cores and node in cores["cores"]:
        prefix = [
            "env",
            f"HPCTRAIN_NODE_CORES={len(cores['cores'][node])}",
            "sh",
            "-c",
            'echo $$ > "$0/cgroup.procs" && exec "$@"',
            f"{cores['dir']}/{node}",
        ]
    return [
        *prefix,
        "nsenter",
        f"--net={NETNS_DIR}/{node}",
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname "$0" && exec "$@"',
        node,
        *argv,
    ]
