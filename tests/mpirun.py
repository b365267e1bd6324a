"""Start real mpirun jobs from single-process tests, always under a hard timeout.

An ordinary launch (`hpctrain ...` or `python SCRIPT ...`, the suite's environment, no
mpirun options) runs on warm ranks (tests/warm_ranks.py): a real `mpirun -np N` job
kept for the session that runs launches one after another, so the suite pays torch's,
TensorFlow's and MPI's start-up once per job instead of once per launch. A launch that
sets its own environment (faults, Open MPI settings), passes mpirun options, or says
`fresh=True` (it measures its processes' memory) gets its own mpirun as before;
HPCTRAIN_TEST_FRESH_LAUNCHES=1 gives every launch its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
HPCTRAIN = str(VENV_BIN / "hpctrain")
PYTHON = sys.executable


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float


class DrainedPopen(subprocess.Popen):
    """A job started in its own process group (stdout and stderr together, text) whose
    output a thread reads from the start; `communicate()` waits and returns all of it.

    A test that polls a job's files before it collects the output must not leave the
    pipe unread: a job that writes more than the pipe holds (64 KiB) blocks in its write
    (measured: rank 0 logging every step at 1,000 steps/s blocked within a second, its
    peers waited in the next collective)."""

    def __init__(self, args, **kwargs):
        kwargs.update(
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        super().__init__(args, **kwargs)
        self._chunks: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True, name="drain")
        self._reader.start()

    def _drain(self) -> None:
        for line in self.stdout:
            self._chunks.append(line)

    def communicate(self, input=None, timeout=None):  # noqa: A002 - Popen's own signature
        """Wait (TimeoutExpired as Popen's), then all the output; the reader gets 30 s
        after the exit for what a process the job left behind still writes."""
        self.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return "".join(self._chunks), None

    def finish(self, timeout: float) -> str:
        """All the output once the job ends; past `timeout` its process group is killed
        and the test fails with what it printed."""
        try:
            out, _ = self.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            out, _ = self.communicate()
            what = " ".join(str(a) for a in self.args)
            raise AssertionError(f"{what} did not end within {timeout:g} s:\n{out}") from None
        return out


# Waiting ranks yield the core (sched_yield) instead of spinning in a blocking MPI call.
# Open MPI does this by itself when it sees more ranks than slots (np > 2 here, with
# --oversubscribe), but not for the emulated nodes, whose 2 + 2 slots share these 2
# cores: measured on the multi-node training tests, 100.6 -> 90.5 s.
YIELD_WHEN_IDLE = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _launch_env(env: dict | None) -> dict:
    full_env = dict(os.environ)
    full_env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1"
    )
    full_env.update(YIELD_WHEN_IDLE)
    full_env.update(env or {})
    return full_env


def _mpirun_args(np: int) -> list[str]:
    return ["mpirun", "-np", str(np), *(["--oversubscribe"] if np > 2 else [])]


# Variables the test process's own imports set in os.environ as the session goes on
# (TensorFlow's, torch's inductor cache, hpctrain's NCCL error handling), which every rank
# sets for itself when it imports the same: not a reason to end a warm job. (Measured:
# test_devices.py's in-process tests ended every warm job and spare started before them.)
_SET_BY_IMPORTS = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "TF_CPP_MIN_LOG_LEVEL",
        "TF2_BEHAVIOR",
        "GRPC_VERBOSITY",
        "ENABLE_RUNTIME_UPTIME_TELEMETRY",
        "TPU_ML_PLATFORM",
        "TPU_ML_PLATFORM_VERSION",
        "HDF5_PLUGIN_PATH",
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


def _env_changes(a: dict, b: dict) -> list[str]:
    """The variables that differ between two launch environments, but those above."""
    keys = (set(a) | set(b)) - _SET_BY_IMPORTS
    return sorted(k for k in keys if a.get(k) != b.get(k))


def _same_env(a: dict, b: dict) -> bool:
    return not _env_changes(a, b)


class WarmJob:
    """One `mpirun -np N tests/warm_ranks.py` job and the launches it runs. `launcher`:
    the mpirun command line before the program (default: this machine's; the emulated
    cluster's places the ranks on its nodes)."""

    def __init__(self, np: int, env: dict, launcher: list[str] | None = None, spare: bool = False):
        self.np, self.env, self.lock, self.runs = np, env, threading.Lock(), 0
        self.spare = spare
        self.launcher = launcher or _mpirun_args(np)
        self.dir = Path(tempfile.mkdtemp(prefix=f"hpctrain-warm{np}-"))
        self.socket = str(self.dir / "socket")
        self.log_path = self.dir / "job.log"
        niced = ["nice", "-n", "19"] if spare else []
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *niced,
                    *self.launcher,
                    PYTHON,
                    str(Path(__file__).with_name("warm_ranks.py")),
                    self.socket,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "HPCTRAIN_WARM_PRELOAD": "1"} if spare else env,
                cwd=ROOT,
                start_new_session=True,
            )
        if spare:
            self.set_group_nice(19)

    def set_group_nice(self, value: int) -> None:
        """The nice value of the job's session: with the kernel's autogroups (each session
        a scheduling group, weighed against the others whatever its processes' own nice),
        a spare niced by `nice` alone took an equal share beside the suite's launches."""
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(f"{value}\n")

    def ready(self) -> bool:
        """Serving: its rank 0 listens once the ranks have imported what they preload."""
        return self.alive() and os.path.exists(self.socket)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _connect(self, deadline: float) -> socket.socket | None:
        while time.monotonic() < deadline and self.alive():
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket)
                return conn
            except OSError:
                conn.close()
                time.sleep(0.05)
        return None

    def _output(self, out: Path, log_from: int) -> str:
        parts = [
            (out / f"rank{r}.log").read_text(errors="replace")
            for r in range(self.np)
            if (out / f"rank{r}.log").exists()
        ]
        with open(self.log_path, "rb") as log:
            log.seek(log_from)
            parts.append(log.read().decode(errors="replace"))
        return "".join(parts)

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, cmd: list[str], cwd: Path, timeout: float, env: dict) -> Job | None:
        """`cmd` on the warm ranks; the job ends with it if it aborts (as its own would).
        None: the job ended before any rank started it (idle timeout): launch it elsewhere."""
        start = time.monotonic()
        out = Path(tempfile.mkdtemp(dir=self.dir))
        log_from = self.log_path.stat().st_size
        conn = self._connect(start + timeout)
        reply = b""
        if conn is not None:
            with conn:
                conn.sendall(
                    (
                        json.dumps({"cmd": cmd, "cwd": str(cwd), "out": str(out), "env": env})
                        + "\n"
                    ).encode()
                )
                conn.settimeout(max(1.0, start + timeout - time.monotonic()))
                try:
                    while not reply.endswith(b"\n"):
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        reply += chunk
                except TimeoutError:
                    output = self._output(out, log_from)
                    self.kill()
                    raise AssertionError(
                        f"mpirun -np {self.np} {' '.join(cmd)} hung for {timeout} s "
                        f"(warm ranks):\n{output}"
                    ) from None
        if reply.endswith(b"\n"):
            answer = json.loads(reply)
            code = next((c for c in answer["codes"] if c != 0), 0)
            output = self._output(out, log_from)
            if answer["retired"]:  # it ends by itself (Horovod started)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=60)
                self.kill()
        else:  # the job ended: an abort, a killed rank (or it could not start)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=max(1.0, start + timeout - time.monotonic()))
            if not any(out.iterdir()) and not self.alive():
                self.kill()
                return None  # no rank ran it
            output = self._output(out, log_from)
            code = self.proc.returncode if self.proc.returncode is not None else 1
            self.kill()
        shutil.rmtree(out, ignore_errors=True)
        return Job(code, output, time.monotonic() - start)

    def close(self) -> None:
        if self.alive() and os.path.exists(self.socket):  # (a spare may still be importing)
            conn = self._connect(time.monotonic() + 5)
            if conn is not None:
                with conn:
                    conn.sendall(b'{"cmd": []}\n')
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=30)
        self.kill()


# Warm jobs by (ranks, launcher: None for this machine's mpirun).
_warm: dict[tuple[int, tuple[str, ...] | None], WarmJob] = {}


def _max_warm_ranks(per_rank_gib: float = 0.75, share: float = 0.5, most: int = 16) -> int:
    """Ranks kept warm at once: each holds torch, and TensorFlow once a run used it
    (measured PSS 0.55-0.62 GiB a rank), in at most half of this machine's memory. On
    24 GiB the suite's 8-rank job fits beside its 1-, 2- and 4-rank ones (15 ranks), so
    the tensor-parallel tests stop restarting them (each restart re-imports torch and
    TensorFlow: about 8 s of CPU a rank)."""
    try:
        with open("/proc/meminfo") as info:
            kib = next(int(line.split()[1]) for line in info if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return 10
    return max(4, min(most, int(kib / 2**20 * share / per_rank_gib)))


# `make test`'s second pytest process (tests marked beside: few warm launches) sets 0.15,
# so the two sessions' warm ranks stay within about two thirds of the machine's memory
MAX_WARM_RANKS = _max_warm_ranks(share=float(os.environ.get("HPCTRAIN_TEST_WARM_SHARE", "0.5")))

# Spares: a warm job ends with a launch that started Horovod, ran doctor or aborted, and
# the next launch of its size would start a new one cold (torch, torch._dynamo and
# TensorFlow imported by every rank: 4-8 s at 2 ranks, 8-16 s at 4 on 2 cores; 13 such
# restarts in a run of the suite). For these sizes a spare job is kept beside the warm
# one, started under `nice -n 19` with everything a launch imports preloaded: it takes
# only CPU the suite leaves idle (a quarter of the suite's time: waits on deadlines,
# SLURM, the emulated nodes), and the next launch of its size takes it over once it has
# imported (tests/conftest.py starts them as the session begins; a launch that took one
# starts the next once it has ended). Its ranks (0.6 GiB each) count in a budget of their
# own, 20% of this machine's memory (on 24 GiB: 2, 4 and 1 ranks).
SPARE_SIZES = (2, 4, 3, 1)  # in this order while the budget has room
MAX_SPARE_RANKS = _max_warm_ranks(per_rank_gib=0.6, share=0.2, most=8)
_spares: dict[int, WarmJob] = {}
# a warm job's key: the variables whose change ended the job that had it
_ENDED_FOR: dict[tuple[int, tuple[str, ...] | None], list[str]] = {}


def _start_spare(np: int) -> None:
    """A niced, preloaded job for the next launch of `np` ranks (where the budget has
    room and the suite asks for warm launches at all)."""
    old = _spares.pop(np, None)
    if old is not None and old.alive() and _same_env(old.env, _launch_env(None)):
        _spares[np] = old
        return
    if old is not None:
        old.close()
    if np not in SPARE_SIZES or os.environ.get("HPCTRAIN_TEST_SPARES") == "0":
        return
    if os.environ.get("HPCTRAIN_TEST_FRESH_LAUNCHES") == "1":  # nothing would take one
        return
    if sum(j.np for j in _spares.values()) + np > MAX_SPARE_RANKS:
        return
    _spares[np] = WarmJob(np, _launch_env(None), spare=True)


def start_spares() -> None:
    """Spares for every size in the budget (tests/conftest.py: once a session has selected
    tests that launch jobs, so they import during the in-process tests that run first)."""
    for size in SPARE_SIZES:
        _start_spare(size)


def _take_spare(np: int, env: dict) -> WarmJob | None:
    """The spare for `np` ranks if it has finished importing; one still importing stays a
    spare for the next time (taken at its priority it would cost this launch more than a
    cold start: TensorFlow too)."""
    spare = _spares.get(np)
    if spare is None or not spare.ready():
        return None
    del _spares[np]
    if not _same_env(spare.env, env):
        spare.close()
        return None
    spare.set_group_nice(0)  # its ranks' threads are reniced by their first request
    return spare


def _key(np: int, launcher: list[str] | None) -> tuple[int, tuple[str, ...] | None]:
    """A warm job's key: its ranks and its launcher (None: this machine's mpirun)."""
    return np, tuple(launcher) if launcher else None


def _warm_job(np: int, env: dict, launcher: list[str] | None) -> WarmJob:
    key = _key(np, launcher)
    job = _warm.get(key)
    if job is not None and (not job.alive() or not _same_env(job.env, env)):
        if job.alive():  # said in the launch log (HPCTRAIN_TEST_LAUNCH_LOG)
            _ENDED_FOR[key] = _env_changes(job.env, env)
        job.close()
        job = None
    if job is None:
        _warm.pop(key, None)
        while _warm and sum(j.np for j in _warm.values()) + np > MAX_WARM_RANKS:
            _warm.pop(next(iter(_warm))).close()
        job = (_take_spare(np, env) if launcher is None else None) or WarmJob(np, env, launcher)
        _warm[key] = job
    else:
        _warm[key] = _warm.pop(key)  # most recently used last
    return job


@atexit.register
def close_warm_jobs(launched_by_others: bool = False) -> None:
    """End the warm jobs (`launched_by_others`: only those with a launcher of their own,
    the emulated cluster's, before a test takes a node away or the cluster goes down)."""
    for key in list(_warm):
        if not launched_by_others or key[1] is not None:
            _warm.pop(key).close()
    if not launched_by_others:
        for np in list(_spares):
            _spares.pop(np).close()


def _run_level_env(env: dict | None) -> bool:
    """Variables read when a run starts (faults, a user model's import path), which warm
    ranks set for that run alone; anything else (Open MPI's, TensorFlow's, Horovod's) is
    read when a process starts and needs a launch of its own."""
    return all(k.startswith("HPCTRAIN_FAULT_") or k == "PYTHONPATH" for k in (env or {}))


def _warm_eligible(cmd: tuple[str, ...], env: dict | None, fresh: bool) -> bool:
    if fresh or not _run_level_env(env) or not cmd:
        return False
    if os.environ.get("HPCTRAIN_TEST_FRESH_LAUNCHES") == "1":
        return False
    if Path(cmd[0]).name == "hpctrain":
        return True
    return cmd[0] == PYTHON and len(cmd) > 1 and cmd[1].endswith(".py")


def mpirun(
    np: int,
    *cmd: str,
    timeout: float = 300,
    env: dict | None = None,
    cwd: str | Path | None = None,
    fresh: bool = False,
    launcher: list[str] | None = None,
) -> Job:
    """Run `cmd` on `np` ranks; stdout+stderr together; killed (and failed) on timeout.
    fresh=True: its own mpirun even where warm ranks could run it (memory measured).
    `launcher`: the mpirun command line (with its options) that starts the `np` ranks,
    instead of this machine's `mpirun -np N` (the emulated cluster's, tests/cluster.py)."""
    full_env = _launch_env(env)
    if _warm_eligible(cmd, env, fresh):
        job = _warm_job(np, _launch_env(None), launcher)
        if job.lock.acquire(blocking=False):
            try:
                if job.alive():
                    result = job.run(list(cmd), Path(cwd or ROOT), timeout, env or {})
                    job.runs += 1
                    if not job.alive():
                        _warm.pop(_key(np, launcher), None)
                    if launcher is None:  # after a launch, not beside it: a taken one replaced
                        start_spares()
                    if result is not None:
                        first = job.runs == 1
                        changed = _ENDED_FOR.pop(_key(np, launcher), None) if first else None
                        return _logged(result, np, cmd, job.runs, job.spare and first, changed)
            finally:
                job.lock.release()
    args = (launcher or _mpirun_args(np)) + list(cmd)
    return _logged(_fresh(args, timeout, full_env, cwd), np, cmd, warm=False)


def _logged(job: Job, np: int, cmd, warm: int | bool, spare: bool = False, env_changed=None) -> Job:
    """HPCTRAIN_TEST_LAUNCH_LOG=FILE: one JSON line per launch (where the suite's time goes);
    warm: False for a launch of its own, else which run of its warm job it was (1: the
    job started for it); spare: a spare took it; env_changed: the variables whose change
    ended the warm job before it."""
    path = os.environ.get("HPCTRAIN_TEST_LAUNCH_LOG")
    if path:
        with open(path, "a") as log:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            what = [Path(c).name for c in cmd[:2]]
            line = {"test": test, "np": np, "warm": warm, "cmd": what, "s": round(job.seconds, 2)}
            if spare:
                line["spare"] = True
            if env_changed:
                line["env_changed"] = env_changed
            log.write(json.dumps(line) + "\n")
    return job


def _fresh(args, timeout, full_env, cwd) -> Job:
    start = time.monotonic()
    proc = DrainedPopen(args, env=full_env, cwd=cwd or ROOT)
    out = proc.finish(timeout)
    return Job(proc.returncode, out, time.monotonic() - start)
