"""A real one-node SLURM cluster for tests: munged, slurmctld and slurmd on loopback.

Everything lives in a temporary directory (slurm.conf, state, spool, logs, pid files),
on free ports, with SLURM_CONF pointing at it, so it disturbs no other SLURM on the
machine. The node declares more CPUs than the machine has (config_overrides), so 2- and
4-task jobs schedule on 2 cores. `stop()` cancels leftover jobs and ends exactly the
daemons this module started, by pid. Every command has a hard timeout.

If anything is missing (not root, binaries absent, a daemon dies), or
HPCTRAIN_SKIP_SLURM=1 is set, `start_cluster` raises SlurmUnavailable with the reason,
and the tests using it are skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
MUNGE_PID_FILE = Path("/run/munge/munged.pid")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be started here; the message says why."""


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def _stop_pid(pid: int, grace: float = 15.0) -> None:
    """SIGTERM `pid`, wait up to `grace` seconds, then SIGKILL it."""
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _read_pid(path: Path, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(path.read_text().split()[0])
            if _alive(pid):
                return pid
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.2)
    return None


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _daemonize(args: list[str], env: dict, log: Path, timeout: float = 30) -> int:
    """Run a daemon's start command (it forks and returns); output goes to `log`, not to
    a pipe that the daemon would hold open."""
    with open(log, "w") as out:
        return subprocess.run(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, timeout=timeout
        ).returncode


def _munge_works(munge: str, unmunge: str) -> bool:
    try:
        cred = subprocess.run([munge, "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        check = subprocess.run([unmunge], input=cred.stdout, capture_output=True, timeout=10)
        return check.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _ensure_munge() -> int | None:
    """Start munged unless it already answers; the pid if this call started it."""
    munge, unmunge, munged = _which("munge"), _which("unmunge"), _which("munged")
    if not (munge and unmunge and munged):
        raise SlurmUnavailable("munge is not installed (apt-get install munge)")
    if _munge_works(munge, unmunge):
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        maker = _which("mungekey")
        cmd = [maker, "--create", "--keyfile", str(key)] if maker else None
        if cmd is None and _which("create-munge-key"):
            cmd = [_which("create-munge-key"), "-f"]
        if cmd is None:
            raise SlurmUnavailable("no munge key and neither mungekey nor create-munge-key")
        subprocess.run(cmd, capture_output=True, timeout=30, check=False)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    log = Path(tempfile.gettempdir()) / "hpctrain-munged.start.log"
    if _daemonize(["runuser", "-u", "munge", "--", munged], dict(os.environ), log) != 0:
        raise SlurmUnavailable(f"munged did not start: {_tail(log)}")
    pid = _read_pid(MUNGE_PID_FILE, 10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _munge_works(munge, unmunge):
        time.sleep(0.2)
    if not _munge_works(munge, unmunge):
        if pid:
            _stop_pid(pid)
        raise SlurmUnavailable("munged started but `munge -n | unmunge` fails")
    return pid


# KillWait: the seconds between a step's SIGTERM and its SIGKILL (30 by default). A rank
# blocked in a collective with a killed peer only records SIGTERM (a preemption request,
# hpctrain/runtime/preemption.py) and is ended by the SIGKILL: measured, the elastic srun
# test waited the whole 30 s ("Waiting up to 32 seconds for job step to finish").
SLURM_CONF = """\
ClusterName=hpctrain-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class SlurmCluster:
    """A running test cluster; `env` is os.environ plus SLURM_CONF (and Open MPI's root
    permission, since slurmd runs jobs as root here)."""

    directory: Path
    conf: Path
    env: dict
    pids: dict[str, int] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 30, cwd=None, check: bool = False, env=None):
        """A SLURM command (or any command) in the cluster's environment (plus `env`),
        time-limited."""
        return subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
            cwd=cwd,
            check=check,
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (empty if SLURM no longer knows the job)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, timeout=20).stdout
        fields = {}
        for word in out.split():
            if "=" in word:
                key, value = word.split("=", 1)
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Poll until the job ends; on timeout cancel it and raise TimeoutError."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(0.25)
        self.run("scancel", job_id, timeout=20)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:g} s")

    def start_requeued_now(self, job_id: str, timeout: float = 240) -> None:
        """Let a requeued job start at once instead of ~2 minutes later (Reason=BeginTime).

        SLURM sets the begin time when the first run has finished completing, which can
        come after the job already shows PENDING; an update sent before that is
        overwritten. So the update is repeated every 2 s until the job leaves PENDING.

        The first update waits until the wall clock is 2 s past the call: slurmd revokes the
        killed run's credential with a time in whole seconds and rejects any credential
        created in that same second ("Killing non-startable batch job: Job credential
        revoked"), so a job restarted within the second of its requeue fails for good. On a
        fast machine the requeue and the forced start landed in one second (CI, stop 21).
        """
        deadline = time.monotonic() + timeout
        not_before = int(time.time()) + 2
        while time.time() < not_before:
            time.sleep(0.2)
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in ("PENDING", "REQUEUED", "COMPLETING"):
                return
            if info.get("JobState") == "PENDING":
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", timeout=20)
            time.sleep(2.0)
        raise TimeoutError(
            f"job {job_id} did not start again within {timeout:g} s\n{self.diagnose(job_id)}"
        )

    def diagnose(self, job_id: str) -> str:
        """What SLURM says about a job and its nodes, and the end of slurmctld's log."""
        parts = []
        for cmd in (("scontrol", "show", "job", job_id), ("sinfo", "-N", "-l")):
            try:
                done = self.run(*cmd, timeout=20)
                parts.append(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                parts.append(f"$ {' '.join(cmd)}: {exc}")
        parts.append(f"slurmctld.log:\n{_tail(self.directory / 'slurmctld.log', 30)}")
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job of this cluster and wait (bounded) until none runs."""
        self.run("scancel", "--user", "root", timeout=20)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-o", "%i", timeout=20).stdout
            if not out.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel leftover jobs, then end exactly the daemons started for this cluster."""
        if "slurmctld" in self.pids:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                _stop_pid(pid)


def start_cluster(directory: Path, cpus: int = 8, timeout: float = 60) -> SlurmCluster:
    """Start munged (if needed), slurmctld and slurmd; wait until the node is idle."""
    if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
        raise SlurmUnavailable("HPCTRAIN_SKIP_SLURM=1 is set")
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster needs root (slurmd runs jobs as root)")
    tools = {n: _which(n) for n in ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")}
    missing = [n for n, path in tools.items() if path is None]
    if missing:
        raise SlurmUnavailable(
            f"not installed: {', '.join(missing)} (make install-test, or tools/install.sh --test)"
        )
    directory = Path(directory)
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(d=directory, ctld_port=_free_port(), slurmd_port=_free_port(), cpus=cpus)
    )
    env = dict(os.environ)
    env.update(
        SLURM_CONF=str(conf),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONUNBUFFERED="1",
    )
    for var in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        if var != "SLURM_CONF":
            del env[var]  # a test run from inside a SLURM job must not leak its job
    cluster = SlurmCluster(directory, conf, env)
    try:
        munged = _ensure_munge()
        if munged is not None:
            cluster.pids["munged"] = munged
        for name, args, pid_file in (
            ("slurmctld", [tools["slurmctld"], "-f", str(conf)], "slurmctld.pid"),
            ("slurmd", [tools["slurmd"], "-f", str(conf), "-N", "localhost"], "slurmd.pid"),
        ):
            code = _daemonize(args, env, directory / f"{name}.start.log")
            pid = _read_pid(directory / pid_file, 15)
            if code != 0 or pid is None:
                raise SlurmUnavailable(
                    f"{name} did not start (exit {code}):\n"
                    f"{_tail(directory / f'{name}.start.log')}\n{_tail(directory / f'{name}.log')}"
                )
            cluster.pids[name] = pid
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = cluster.run("sinfo", "-h", "-N", "-o", "%T", timeout=20).stdout.strip()
            if state == "idle":
                return cluster
            time.sleep(0.5)
        raise SlurmUnavailable(
            f"node not idle after {timeout:g} s (state {state!r}):\n"
            f"{_tail(directory / 'slurmd.log')}"
        )
    except BaseException:
        cluster.stop()
        raise
