"""`hpctrain cluster`, the emulated multi-node cluster, as a tool: names, addresses,
arguments and refusals (no root needed), then up/down on this machine (root): it makes
what it says, removes exactly that (never an object it did not make, even one carrying
its names), leaves /etc/hosts as it found it, cleans up after a killed session, and
refuses clearly without the capabilities it needs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from cluster import unavailable_reason
from mpirun import HPCTRAIN

from hpctrain.cluster import ClusterError, Lock, Plan, link_rate, mpirun_args, netns, session
from hpctrain.cluster.agent import agent_script, on_node, write_agent
from hpctrain.cluster.plan import HOSTS_TAG, IFNAMSIZ, node_cores, tbf_args
from hpctrain.cluster.system import add_hosts_lines, remove_hosts_lines, tagged_hosts_lines


# --- plan: pure, no root ------------------------------------------------------------------
def test_link_speeds_and_their_refusal():
    assert link_rate("1gbit") == 1e9
    assert link_rate("10GBIT") == 10e9
    assert link_rate("25gbit") == 25e9
    assert link_rate("100mbit") == 1e8
    assert link_rate("none") is None
    for bad in ("fast", "10gbps", "0gbit", "-1gbit", ""):
        with pytest.raises(ClusterError, match="is not a link speed: use one of 1gbit"):
            link_rate(bad)


def test_token_bucket_holds_a_gso_packet_but_not_a_gradient():
    for rate in (1e9, 10e9, 25e9):
        args = tbf_args(rate)
        burst = int(args[args.index("burst") + 1])
        assert burst >= 64 * 1024  # a GSO super-packet must fit, or nothing passes
        assert burst <= 1 << 20  # a few-MB gradient cannot ride the burst
        assert args[args.index("rate") + 1] == f"{int(rate)}bit"


def test_plan_names_addresses_hosts_and_hostfile():
    plan = Plan(3, "10gbit")
    nodes = plan.node_list()
    assert [n.name for n in nodes] == ["hpcn1", "hpcn2", "hpcn3"]
    assert [n.address for n in nodes] == ["10.213.0.11/24", "10.213.0.12/24", "10.213.0.13/24"]
    assert [n.veth for n in nodes] == ["hpcn1-veth", "hpcn2-veth", "hpcn3-veth"]
    assert all(len(n.veth) <= 15 for n in Plan(200).node_list())  # Linux IFNAMSIZ
    assert plan.bridge_address == "10.213.0.1/24"
    assert plan.hosts_lines()[1] == f"10.213.0.12 hpcn2 {HOSTS_TAG}"
    assert plan.hostfile_text(2) == "hpcn1 slots=2\nhpcn2 slots=2\nhpcn3 slots=2\n"
    assert Plan(1, subnet="10.99.8.0/24").node_list()[0].address == "10.99.8.11/24"


def test_plan_names_come_from_the_bridge_and_prefix_chosen():
    plan = Plan(2, subnet="10.214.7.0/24", bridge="tbr9", prefix="tn")
    assert [(n.name, n.veth) for n in plan.node_list()] == [
        ("tn1", "tn1-veth"),
        ("tn2", "tn2-veth"),
    ]
    assert plan.hosts_lines() == [f"10.214.7.11 tn1 {HOSTS_TAG}", f"10.214.7.12 tn2 {HOSTS_TAG}"]
    args = mpirun_args(plan, "/x/rsh-agent", per_node=1)
    assert args[args.index("--host") + 1] == "tn1:1,tn2:1"
    longest = Plan(200, prefix="node-").node_list()[-1].veth
    assert longest == "node-200-veth" and len(longest) <= IFNAMSIZ


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"nodes": 2, "prefix": "9n"}, "--prefix '9n' cannot name 2 node(s)"),
        ({"nodes": 2, "prefix": "Hpc"}, "--prefix 'Hpc' cannot name"),
        ({"nodes": 2, "prefix": "n1"}, "ending in a letter or '-'"),
        ({"nodes": 200, "prefix": "toolongx"}, "'toolongx200-veth' fits 15 characters"),
        ({"nodes": 2, "bridge": "br 0"}, "--bridge 'br 0' is not an interface name"),
        ({"nodes": 2, "bridge": "b" * 16}, "up to 15 letters"),
        ({"nodes": 2, "bridge": "hpcn1"}, "--bridge 'hpcn1' is named like a node"),
        ({"nodes": 2, "bridge": "hpcn2-veth"}, "is named like a node or its link"),
    ],
)
def test_bad_names_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(ClusterError, match=re.escape(message)):
        Plan(**kwargs)


def test_down_removes_only_what_the_state_lists():
    """The list `down` works from: what `up` recorded (an earlier version's state file
    lists its planned objects); no state, nothing, whatever carries the default names."""
    assert netns.listed(None) == {"bridge": [], "namespace": [], "link": [], "hosts": []}
    state = {
        "made": [
            {"kind": "bridge", "name": "tbr9"},
            {"kind": "namespace", "name": "tn1"},
            {"kind": "link", "name": "tn1-veth"},
        ],
        "hosts_lines": [f"10.214.7.11 tn1 {HOSTS_TAG}"],
        "bridge": "tbr9",
        "nodes": ["tn1", "tn2"],  # tn2 was planned, never made: not listed
        "veths": {"tn1": "tn1-veth", "tn2": "tn2-veth"},
    }
    assert netns.listed(state) == {
        "bridge": ["tbr9"],
        "namespace": ["tn1"],
        "link": ["tn1-veth"],
        "hosts": [f"10.214.7.11 tn1 {HOSTS_TAG}"],
    }
    old = {
        "bridge": "hpcbr0",
        "nodes": ["hpcn1"],
        "veths": {"hpcn1": "hpcn1-veth"},
        "addresses": {"hpcn1": "10.213.0.11"},
    }
    assert netns.listed(old) == {
        "bridge": ["hpcbr0"],
        "namespace": ["hpcn1"],
        "link": ["hpcn1-veth"],
        "hosts": [f"10.213.0.11 hpcn1 {HOSTS_TAG}"],
    }


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"nodes": 0}, "--nodes must be between 1 and 200"),
        ({"nodes": 201}, "--nodes must be between 1 and 200"),
        ({"nodes": 2, "subnet": "10.213.0.0/28"}, "must be an IPv4 network of /24 or larger"),
        ({"nodes": 2, "subnet": "10.213.0.5/24"}, "is not a network"),
        ({"nodes": 2, "link": "warp"}, "is not a link speed"),
    ],
)
def test_bad_plans_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        Plan(**kwargs)


def test_mpirun_arguments_confine_open_mpi_to_the_cluster():
    args = mpirun_args(Plan(2), "/run/x/rsh-agent", per_node=2)
    pairs = {args[i + 1]: args[i + 2] for i, a in enumerate(args) if a == "--mca"}
    assert pairs["plm_rsh_agent"] == "/run/x/rsh-agent"
    assert pairs["btl"] == "self,vader,tcp"
    assert pairs["btl_tcp_if_include"] == pairs["oob_tcp_if_include"] == "10.213.0.0/24"
    assert int(pairs["oob_tcp_keepalive_time"]) <= 5  # a vanished node is noticed in seconds
    assert args[args.index("--host") + 1] == "hpcn1:2,hpcn2:2"
    with pytest.raises(ClusterError, match="--per-node must be at least 1"):
        mpirun_args(Plan(2), "a", per_node=0)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the kernel's cpu list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_nodes_get_their_own_cores_or_share_them_round_robin():
    assert node_cores([0, 1], 2) == [[0], [1]]
    assert node_cores([3, 1, 0, 2], 2) == [[0, 1], [2, 3]]
    assert node_cores([0, 1, 2], 2) == [[0], [1]]  # the spare core is left to the system
    assert node_cores([0, 1], 3) == [[0], [1], [0]]  # more nodes than cores: shared
    assert node_cores([5], 1) == [[5]]
    assert parse_cpu_list("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ClusterError, match="no cores"):
        node_cores([], 2)


def test_on_node_joins_the_nodes_cpuset_and_says_its_cores():
    cores = {"dir": "/run/x/cpuset/hpctrain-cluster", "cores": {"hpcn2": [1]}}
    argv = on_node("hpcn2", ["hostname"], cores)
    assert argv[:2] == ["env", "HPCTRAIN_NODE_CORES=1"]
    assert "/run/x/cpuset/hpctrain-cluster/hpcn2" in argv
    assert argv[argv.index("nsenter") + 1] == "--net=/run/netns/hpcn2"
    script = agent_script(["hpcn1", "hpcn2"], {"dir": "/d", "cores": {"hpcn1": [0], "hpcn2": [1]}})
    assert 'echo $$ > "/d/$host/cgroup.procs" || exit 255' in script
    assert "hpcn2) ncores=1;;" in script


def test_on_node_passes_arguments_without_a_shell():
    argv = on_node("hpcn2", ["echo", "a b", "[32]", "$HOME"])
    assert argv[:2] == ["nsenter", "--net=/run/netns/hpcn2"]
    assert argv[-4:] == ["echo", "a b", "[32]", "$HOME"]  # exec "$@": no word splitting


def test_rsh_agent_refuses_a_host_that_is_not_a_node(tmp_path):
    agent = write_agent(tmp_path / "rsh-agent", ["hpcn1", "hpcn2"])
    assert "hpcn1 hpcn2" in agent_script(["hpcn1", "hpcn2"])
    proc = subprocess.run(
        [str(agent), "-x", "somehost", "orted", "--foo"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 255
    assert "'somehost' is not a node of the emulated cluster (hpcn1 hpcn2)" in proc.stderr


def test_hosts_lines_are_added_and_removed_leaving_the_rest_byte_identical(tmp_path):
    hosts = tmp_path / "hosts"
    original = "127.0.0.1 localhost\n# a comment\n10.0.0.5 db  # hpctrain-cluster-not\n"
    hosts.write_text(original)
    inode = hosts.stat().st_ino
    lines = Plan(2).hosts_lines()
    add_hosts_lines(lines, HOSTS_TAG, hosts)
    add_hosts_lines(lines, HOSTS_TAG, hosts)  # twice: still one copy
    assert tagged_hosts_lines(HOSTS_TAG, hosts) == lines
    assert remove_hosts_lines(HOSTS_TAG, hosts) == 2
    assert hosts.read_text() == original
    assert hosts.stat().st_ino == inode  # rewritten in place (it may be a bind mount)


def test_a_clusters_hosts_lines_leave_another_clusters_alone(tmp_path):
    hosts = tmp_path / "hosts"
    other = f"10.99.0.11 other1 {HOSTS_TAG}"  # another cluster's (another state dir)
    hosts.write_text(f"127.0.0.1 localhost\n{other}\n")
    lines = Plan(2, bridge="tbr9", prefix="tn").hosts_lines()
    add_hosts_lines(lines, HOSTS_TAG, hosts)
    assert tagged_hosts_lines(HOSTS_TAG, hosts) == [other, *lines]
    assert tagged_hosts_lines(HOSTS_TAG, hosts, lines=lines) == lines
    assert remove_hosts_lines(HOSTS_TAG, hosts, lines=lines) == 2
    assert hosts.read_text() == f"127.0.0.1 localhost\n{other}\n"


def test_lock_names_its_holder(tmp_path):
    first, second = Lock(tmp_path), Lock(tmp_path)
    first.acquire(0, "pytest first")
    try:
        with pytest.raises(ClusterError, match=r"in use by pid \d+ \(pytest first\)"):
            second.acquire(0.6, "second")
    finally:
        first.release()
    second.acquire(0, "second")
    second.release()


# --- on this machine: needs root ----------------------------------------------------------
needs_root = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _hpctrain(*args, prefix=(), timeout=60):
    return subprocess.run(
        [*prefix, HPCTRAIN, "cluster", *args], capture_output=True, text=True, timeout=timeout
    )


def test_refusal_without_the_capabilities_names_them():
    if subprocess.run(["which", "setpriv"], capture_output=True).returncode != 0:
        pytest.skip("setpriv (util-linux) is not installed")
    drop = ["setpriv", "--bounding-set=-net_admin,-sys_admin"]
    if subprocess.run([*drop, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot drop capabilities here (setpriv --bounding-set refused)")
    proc = _hpctrain("up", "--nodes", "2", prefix=drop)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line, no traceback
    assert "needs root: this process lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in proc.stderr


@needs_root
def test_files_merely_called_like_the_clusters_are_never_touched(tmp_path):
    """HPCTRAIN_CLUSTER_DIR pointed at a shared directory: a user's hostfile, rsh-agent,
    lock and state-less files survive `down`, `up` refuses to write over them, and the
    lock is a file of its own."""
    mine = {"hostfile": "node7 slots=4\n", "rsh-agent": "#!/bin/sh\n", "lock": "my notes\n"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    assert netns.down(tmp_path) == []
    with pytest.raises(ClusterError, match="holds rsh-agent, hostfile that no cluster state"):
        netns.up(Plan(2), "pytest", state_dir=tmp_path)
    lock = Lock(tmp_path)
    lock.acquire(0, "pytest")
    lock.release()
    assert {n: (tmp_path / n).read_text() for n in mine} == mine
    assert not netns.state_path(tmp_path).exists()


@needs_root
def test_up_status_down_leave_the_machine_as_they_found_it(tmp_path):
    hosts_before = Path("/etc/hosts").read_text()
    lock = Lock()
    lock.acquire(600, "pytest test_cluster_tool")
    other_ns = "hpctest-not-ours"
    try:
        netns.down()  # leftovers of a killed earlier run, if any
        subprocess.run(["ip", "netns", "add", other_ns], check=True, timeout=30)
        state = netns.up(Plan(2, "1gbit"), owner="pytest")
        assert state["complete"] and state["nodes"] == ["hpcn1", "hpcn2"]
        info = netns.status()
        assert info["nodes"]["hpcn2"]["link"] == "up"
        assert info["nodes"]["hpcn2"]["shaped_bps"] == 1e9
        assert "10.213.0.12 hpcn2 # hpctrain-cluster" in Path("/etc/hosts").read_text()
        # The agent runs a command inside the node, under the node's name.
        proc = subprocess.run(
            [state["agent"], "hpcn2", "hostname;", "ip", "-4", "-o", "addr", "show", "eth0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == "hpcn2"
        assert "10.213.0.12/24" in proc.stdout
        # Each node runs on its own cores (a cpuset cgroup), and says how many it has.
        if state["cores"]:
            own = {}
            for node in state["nodes"]:
                proc = subprocess.run(
                    [
                        state["agent"],
                        node,
                        "grep",
                        "Cpus_allowed_list",
                        "/proc/self/status;",
                        "echo",
                        "$HPCTRAIN_NODE_CORES",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert proc.returncode == 0, proc.stderr
                allowed, count = proc.stdout.split()[-2:]
                own[node] = parse_cpu_list(allowed)
                assert own[node] == state["cores"]["cores"][node]
                assert int(count) == len(own[node])
            if len(os.sched_getaffinity(0)) >= 2:
                assert not set(own["hpcn1"]) & set(own["hpcn2"])
        netns.set_link("hpcn2", False)
        assert netns.status()["nodes"]["hpcn2"]["link"] == "down"
        netns.shape("none")
        assert netns.status()["nodes"]["hpcn1"]["shaped_bps"] is None
        with pytest.raises(ClusterError, match="already up"):
            netns.up(Plan(2), owner="pytest")
        removed = netns.down()
        assert "namespace hpcn1" in removed and "bridge hpcbr0" in removed
        assert not state["cores"] or any(r.startswith("cpusets ") for r in removed)
    finally:
        netns.down()
        subprocess.run(["ip", "netns", "del", other_ns], timeout=30)
        lock.release()
    assert not netns.leftovers()
    assert Path("/etc/hosts").read_text() == hosts_before
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hpcn" not in listed


@needs_root
def test_without_cpusets_the_nodes_share_the_cores_and_status_says_why(monkeypatch):
    from hpctrain.cluster import cores

    def no_cpusets(state_dir, nodes, group_name=None):
        raise OSError("cpuset controller busy")

    monkeypatch.setattr(cores, "create", no_cpusets)
    lock = Lock()
    lock.acquire(600, "pytest test_cluster_tool")
    try:
        netns.down()
        state = netns.up(Plan(2), owner="pytest")
        assert state["complete"] and state["cores"] is None
        assert "cpuset controller busy" in state["cores_unavailable"]
        assert "cgroup.procs" not in Path(state["agent"]).read_text()
        assert netns.status()["nodes"]["hpcn1"]["cores"] is None
    finally:
        netns.down()
        lock.release()
    assert not netns.leftovers()


@needs_root
def test_a_subnet_already_in_use_is_refused():
    # Read-only: needs no lock, and runs while another session holds the cluster.
    used = subprocess.run(
        ["ip", "-4", "-o", "route", "show", "scope", "link"], capture_output=True, text=True
    ).stdout.split()
    if not used:
        pytest.skip("no link-scope IPv4 route on this machine to collide with")
    subnet = used[0] if "/" in used[0] else f"{used[0]}/32"
    if int(subnet.split("/")[1]) > 24:
        pytest.skip(f"{subnet} is narrower than the /24 a cluster needs")
    with pytest.raises(ClusterError, match=f"--subnet {subnet} is in use"):
        netns.check_subnet_free(Plan(2, subnet=subnet))
    assert not netns.leftovers()


@needs_root
def test_a_session_cleans_up_after_a_killed_one():
    lock = Lock()
    lock.acquire(600, "pytest test_cluster_tool")
    try:
        netns.down()
        netns.up(Plan(2), owner="a session that was then killed")
    finally:
        lock.release()  # as the kernel does when the holder dies
    with session(nodes=3, what="pytest test_cluster_tool") as c:
        assert c.nodes == ["hpcn1", "hpcn2", "hpcn3"]
        assert netns.read_state()["owner"] == "pytest test_cluster_tool"
    assert not netns.leftovers()


@needs_root
def test_cli_up_mpirun_args_and_down(tmp_path):
    lock = Lock()
    lock.acquire(600, "pytest test_cluster_tool")
    lock.release()  # waited for any running session; the CLI takes it itself
    up = _hpctrain("up", "--nodes", "2", "--link", "10gbit")
    try:
        assert up.returncode == 0, up.stderr
        assert "cluster up: 2 node(s) (hpcn1 10.213.0.11, hpcn2 10.213.0.12)" in up.stdout
        args = _hpctrain("mpirun-args", "--per-node", "2").stdout.split()
        assert args[args.index("--host") + 1] == "hpcn1:2,hpcn2:2"
        status = _hpctrain("status")
        assert status.returncode == 0 and "10 Gbit/s" in status.stdout, status.stdout
        run = _hpctrain("run", "--node", "hpcn2", "--", "hostname")
        assert run.returncode == 0 and run.stdout.strip() == "hpcn2", run.stderr
    finally:
        down = _hpctrain("down")
    assert down.returncode == 0, down.stderr
    assert _hpctrain("status").returncode == 1


FOREIGN_BRIDGE, FOREIGN_NAMESPACE = "hpcbr0", "hpcn1"  # the tool's default names


@needs_root
def test_foreign_objects_with_the_clusters_names_survive_up_and_down(tmp_path):
    """A bridge and a namespace this tool did not make, named as its defaults name its
    own: `down` leaves them (it used to remove anything called hpcbr0 or hpcnK), `up`
    refuses the clash in one line that names the object and the option that picks other
    names (it used to advise `down`, which would have deleted them), and a cluster under
    other names comes up, runs and goes down beside them."""
    lock = Lock()  # the default names: no session may run while the foreign ones exist
    lock.acquire(600, "pytest test_cluster_tool (foreign names)")
    state_dir = tmp_path / "state"  # this cluster's own state dir (and lock)
    env = {**os.environ, "HPCTRAIN_CLUSTER_DIR": str(state_dir)}
    hosts_before = Path("/etc/hosts").read_text()
    undo: list[list[str]] = []

    def cli(*args):
        return subprocess.run(
            [HPCTRAIN, "cluster", *args], capture_output=True, text=True, timeout=120, env=env
        )

    def foreign_ones_exist() -> bool:
        bridge = subprocess.run(["ip", "link", "show", FOREIGN_BRIDGE], capture_output=True)
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return bridge.returncode == 0 and FOREIGN_NAMESPACE in spaces.stdout.split()

    try:
        if netns.read_state():
            pytest.skip("a cluster brought up by `hpctrain cluster up` is running here")
        for make, remove in (
            (["ip", "link", "add", FOREIGN_BRIDGE, "type", "bridge"], ["ip", "link", "del"]),
            (["ip", "netns", "add", FOREIGN_NAMESPACE], ["ip", "netns", "del"]),
        ):
            subprocess.run(make, check=True, capture_output=True, timeout=30)
            undo.append([*remove, make[3]])
        # Nothing listed, nothing removed, whatever carries the emulation's names.
        down = cli("down")
        assert down.returncode == 0 and "nothing to remove" in down.stdout, down.stderr
        assert foreign_ones_exist()
        # A clash: one line naming the object and how to choose another name.
        for extra, says, option in (
            ((), f"a network interface {FOREIGN_BRIDGE} already exists", "--bridge NAME"),
            (("--bridge", "tbr9"), f"network namespace {FOREIGN_NAMESPACE} already", "--prefix"),
        ):
            up = cli("up", "--nodes", "2", *extra)
            assert up.returncode == 2, up.stdout + up.stderr
            assert up.stderr.count("\n") == 1 and "Traceback" not in up.stderr, up.stderr
            assert says in up.stderr and option in up.stderr, up.stderr
            assert "not this cluster's" in up.stderr and "down" not in up.stderr, up.stderr
            assert not state_dir.joinpath("state.json").exists()
        assert foreign_ones_exist()
        # Other names: up, a command on a node, status, down; the foreign ones stay.
        names = ("--bridge", "tbr9", "--prefix", "tn", "--subnet", "10.214.7.0/24")
        up = cli("up", "--nodes", "2", *names)
        assert up.returncode == 0, up.stderr
        assert "(tn1 10.214.7.11, tn2 10.214.7.12) on bridge tbr9 10.214.7.1/24" in up.stdout
        state = json.loads((state_dir / "state.json").read_text())
        assert (state["bridge"], state["prefix"], state["subnet"]) == (
            "tbr9",
            "tn",
            "10.214.7.0/24",
        )
        made = [(m["kind"], m["name"]) for m in state["made"]]
        assert made == [
            ("bridge", "tbr9"),
            ("namespace", "tn1"),
            ("link", "tn1-veth"),
            ("namespace", "tn2"),
            ("link", "tn2-veth"),
        ]
        run = cli("run", "--node", "tn2", "--", "hostname")
        assert run.returncode == 0 and run.stdout.strip() == "tn2", run.stderr
        status = cli("status")
        assert status.returncode == 0 and "bridge tbr9 10.214.7.1/24" in status.stdout
        assert "10.214.7.12 tn2 # hpctrain-cluster" in Path("/etc/hosts").read_text()
        down = cli("down")
        assert down.returncode == 0, down.stderr
        assert "bridge tbr9" in down.stdout and "namespace tn1" in down.stdout, down.stdout
        assert FOREIGN_BRIDGE not in down.stdout and FOREIGN_NAMESPACE not in down.stdout
        assert foreign_ones_exist()
        assert cli("status").returncode == 1
        assert Path("/etc/hosts").read_text() == hosts_before
    finally:
        with contextlib.suppress(ClusterError):
            netns.down(state_dir)
        for argv in reversed(undo):
            subprocess.run(argv, capture_output=True, timeout=30)
        lock.release()
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tn1" not in spaces.split() and FOREIGN_NAMESPACE not in spaces.split()


# --- what `make bench` derives from the cluster's measurements ----------------------------
def test_network_section_overlap_ratio_and_projection_by_hand():
    from benchmarks.sections import network

    compute = {"step": {"mean": 0.020}}
    rows = [
        {"step": {"mean": 0.050}},  # compute then comm: no overlap
        {"step": {"mean": 0.030}},  # compute hidden entirely behind comm
        {"step": {"mean": 0.040}},  # half of it hidden
        {"step": {"mean": 0.060}},  # costs more than both
    ]
    comm = {"seconds": 0.030, "fit": {"alpha": 1e-4, "beta": 5e-9}}
    network._derive([{"compute": compute, "comm": comm, "rows": rows}], [1e6, 2e6])
    assert [r["overlap"] for r in rows] == pytest.approx([0.0, 1.0, 0.5, -0.5])
    assert [r["step_over_bound"] for r in rows] == pytest.approx([50 / 30, 1.0, 40 / 30, 2.0])
    # compute + T(2, S) = 0.020 + 2·α + β·S = 0.020 + 0.0002 + 0.015
    assert rows[0]["projection"]["no_overlap"] == pytest.approx(0.0352)
    assert rows[0]["projection"]["error_no_overlap"] == pytest.approx(0.0352 / 0.050 - 1)
    # overlap: only what outlasts 2/3 of the compute shows: 0.020 + (0.0152 - 0.01333)
    assert rows[0]["projection"]["overlap"] == pytest.approx(0.020 + 0.0152 - 0.020 * 2 / 3)
