"""The emulated two-node cluster for tests: a pytest fixture that always tears it down.

`two_nodes()` (for a module-scoped fixture) brings up hpcn1 and hpcn2 through `hpctrain.cluster.session`,
which holds the cluster's lock (a concurrent test run waits its turn), removes what a
killed earlier run left behind, and takes everything down again however the module
ends: `finally`, an atexit hook, and SIGTERM turned into SystemExit. Where namespaces
cannot be made here (not root, no `ip`), the tests are skipped with that reason;
HPCTRAIN_SKIP_MULTINODE=1 skips them too.

`launch()` runs an mpirun job across the nodes under a hard timeout, killing the whole
process group (mpirun and everything on both nodes) if it hangs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest
from mpirun import ROOT, YIELD_WHEN_IDLE, DrainedPopen, close_warm_jobs, mpirun

from hpctrain.cluster import ClusterUnavailable, session
from hpctrain.cluster.system import missing_capabilities, missing_tools

ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PYTHONUNBUFFERED": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    **YIELD_WHEN_IDLE,  # the emulated nodes share this machine's cores (tests/mpirun.py)
}


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.environ.get("HPCTRAIN_SKIP_MULTINODE") == "1":
        return "HPCTRAIN_SKIP_MULTINODE=1 is set"
    caps = missing_capabilities()
    if caps:
        return f"the emulated cluster needs root: this process lacks {' and '.join(caps)}"
    tools = missing_tools()
    if tools:
        return f"the emulated cluster needs {', '.join(tools)}"
    return None


def two_nodes():
    """Generator for a module-scoped fixture: `yield from cluster.two_nodes()`."""
    reason = unavailable_reason()
    if reason:
        print(f"\nmulti-node tests skipped: {reason}")
        pytest.skip(reason)
    try:
        with session(nodes=2, link="none", wait=240, what="pytest multi-node tier") as c:
            try:
                yield c
            finally:
                close_warm_jobs(launched_by_others=True)  # their ranks live on the nodes
    except ClusterUnavailable as exc:
        print(f"\nmulti-node tests skipped: {exc}")
        pytest.skip(str(exc))


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float


def start(argv: list[str], env: dict | None = None) -> DrainedPopen:
    """Start a job in its own process group, stdout and stderr together. Warm ranks on
    the nodes end first: a job of its own may take a node away, and its timing is the
    test's."""
    close_warm_jobs(launched_by_others=True)
    full = dict(os.environ)
    full.update(ENV)
    full.update(env or {})
    return DrainedPopen(argv, env=full, cwd=ROOT)


def finish(proc: DrainedPopen, timeout: float, started: float | None = None) -> Job:
    """Wait for a started job; on timeout kill its process group and fail the test."""
    started = time.monotonic() if started is None else started
    out = proc.finish(timeout)
    return Job(proc.returncode, out, time.monotonic() - started)


def launch(argv: list[str], timeout: float = 180, env: dict | None = None) -> Job:
    t0 = time.monotonic()
    return finish(start(argv, env), timeout, t0)


def launch_across(cluster, per_node: int, *cmd: str, hosts: str | None = None, timeout=300):
    """`cmd` (hpctrain ...) on `per_node` ranks of each node (or the `--host` list
    `hosts`), on warm ranks placed the same way when it is an ordinary launch
    (tests/mpirun.py): the same Open MPI placement, transports and namespaces as its own
    mpirun, without paying torch's and TensorFlow's start-up again."""
    ranks = sum(int(h.split(":")[1]) for h in hosts.split(",")) if hosts else 2 * per_node
    return mpirun(ranks, *cmd, timeout=timeout, launcher=cluster.mpirun(per_node, hosts=hosts))


# --- SLURM across the emulated nodes --------------------------------------------------------
# slurmctld on this machine (reached at the bridge address), one slurmd inside each node's
# namespace under the node's hostname, and a munged of their own on a private socket (so
# the single-node SLURM tests' munged is neither needed nor disturbed). Each node gets its
# own PMIx scratch directory (mpi.conf next to its own copy of slurm.conf): the nodes share
# /tmp, where PMIx would otherwise create the same directory on both.
SLURM_TWO_NODES_CONF = """\
ClusterName=hpctrain-two-nodes
SlurmctldHost={ctld_host}({ctld_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def start_slurm_on(cluster, directory, timeout: float = 60, extra_conf: str = ""):
    """A SLURM cluster whose compute nodes are the emulated nodes; `.stop()` ends it.
    extra_conf: more slurm.conf lines (e.g. a short SlurmdTimeout for node loss)."""
    import socket
    from pathlib import Path

    from slurm_cluster import (
        SlurmCluster,
        SlurmUnavailable,
        _daemonize,
        _free_port,
        _read_pid,
        _tail,
        _which,
    )

    if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
        raise SlurmUnavailable("HPCTRAIN_SKIP_SLURM=1 is set")
    tools = {n: _which(n) for n in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")}
    missing = [n for n, path in tools.items() if path is None]
    if missing:
        raise SlurmUnavailable(
            f"not installed: {', '.join(missing)} (make install-test, or tools/install.sh --test)"
        )
    d = Path(directory)
    for sub in ("state", *(f"spool/{n}" for n in cluster.nodes)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    # munged runs as user munge: its directory cannot be inside pytest's private tmp.
    munge = Path(cluster.state_dir) / "munge"
    shutil.rmtree(munge, ignore_errors=True)
    munge.mkdir(mode=0o755)
    subprocess.run(["chown", "munge:munge", str(munge)], check=True, timeout=30)
    conf_text = SLURM_TWO_NODES_CONF.format(
        d=d,
        munge=munge,
        ctld_host=socket.gethostname(),
        ctld_addr=cluster.state["bridge_address"].split("/")[0],
        ctld_port=_free_port(),
        slurmd_port=_free_port(),
        nodes="\n".join(
            f"NodeName={n} NodeAddr={cluster.state['addresses'][n]} CPUs=4 RealMemory=8000 "
            "State=UNKNOWN"
            for n in cluster.nodes
        ),
        node_list=",".join(cluster.nodes),
    )
    conf = d / "slurm.conf"
    conf_text += extra_conf
    conf.write_text(conf_text)
    env = dict(os.environ)
    env.update(SLURM_CONF=str(conf), **ENV)
    for var in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        if var != "SLURM_CONF":
            del env[var]
    slurm = SlurmCluster(d, conf, env)
    slurm.munge_dir = munge
    try:
        code = _daemonize(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                tools["munged"],
                f"--socket={munge}/munge.sock",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/seed",
                f"--log-file={munge}/log",
            ],
            env,
            d / "munged.start.log",
        )
        pid = _read_pid(munge / "munged.pid", 15)
        if code != 0 or pid is None:
            raise SlurmUnavailable(f"munged did not start: {_tail(d / 'munged.start.log')}")
        slurm.pids["munged"] = pid
        code = _daemonize([tools["slurmctld"], "-f", str(conf)], env, d / "slurmctld.start.log")
        pid = _read_pid(d / "slurmctld.pid", 15)
        if code != 0 or pid is None:
            raise SlurmUnavailable(f"slurmctld did not start: {_tail(d / 'slurmctld.log')}")
        slurm.pids["slurmctld"] = pid
        for n in cluster.nodes:
            etc = d / f"etc-{n}"
            (etc / "pmix").mkdir(parents=True, exist_ok=True)
            (etc / "slurm.conf").write_text(conf_text)
            (etc / "mpi.conf").write_text(f"PMIxCliTmpDirBase={etc / 'pmix'}\n")
            # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup
            # file system slurmd needs.
            start = [
                "nsenter",
                f"--net=/run/netns/{n}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                'hostname "$0" && exec "$@"',
                n,
                tools["slurmd"],
                "-f",
                str(etc / "slurm.conf"),
                "-N",
                n,
            ]
            code = _daemonize(start, env, d / f"slurmd.{n}.start.log")
            pid = _read_pid(d / f"slurmd.{n}.pid", 15)
            if code != 0 or pid is None:
                raise SlurmUnavailable(
                    f"slurmd on {n} did not start: {_tail(d / f'slurmd.{n}.log')}"
                )
            slurm.pids[f"slurmd-{n}"] = pid
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            states = slurm.run("sinfo", "-h", "-N", "-o", "%T", timeout=20).stdout.split()
            if states == ["idle"] * len(cluster.nodes):
                return slurm
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout:g} s: {states}")
    except BaseException:
        stop_slurm(slurm)
        raise


def stop_slurm(slurm) -> None:
    """Cancel its jobs, then end exactly the daemons it started, by pid."""
    from slurm_cluster import _stop_pid

    if "slurmctld" in slurm.pids:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            slurm.cancel_all(timeout=30)
    for name in sorted(slurm.pids, key=lambda k: (not k.startswith("slurmd"), k != "slurmctld")):
        _stop_pid(slurm.pids.pop(name))
    shutil.rmtree(slurm.munge_dir, ignore_errors=True)
