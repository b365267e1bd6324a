"""Running a command "on a node": inside its network namespace, under its hostname.

Two users: Open MPI, which starts its daemon on every remote node through an rsh agent
(called like ssh: `AGENT [options] HOST COMMAND...`), and the tests and benchmarks,
which start mpirun itself on the first node, as a batch script's mpirun runs on the
first node of its allocation.
"""

from __future__ import annotations

from pathlib import Path

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
exec ip netns exec "$host" unshare --uts setpriv --pdeathsig KILL -- \\
    sh -c 'hostname "$0" && eval "$1"' "$host" "$cmd"
"""


def agent_script(node_names: list[str]) -> str:
    return AGENT_TEMPLATE.replace("{nodes}", " ".join(node_names))


def write_agent(path: Path, node_names: list[str]) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(agent_script(node_names))
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def on_node(node: str, argv: list[str]) -> list[str]:
    """argv that runs `argv` (no shell involved) on `node` with `node` as hostname."""
    return [
        "ip",
        "netns",
        "exec",
        node,
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname "$0" && exec "$@"',
        node,
        *argv,
    ]
