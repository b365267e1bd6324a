"""One run at a time in a run directory: `<run-dir>/.hpctrain-running`, kept by rank 0.

Why: the same sbatch script submitted twice, or one command started twice, ran two jobs
in one directory (the templates always pass `--resume auto`): both wrote checkpoints of
the same steps and pruned each other's, and the timeline was neither run's.

The marker names its run (host, pid, SLURM job, start) and its modification time is a
heartbeat, renewed every HEARTBEAT_S by a thread of rank 0. A run that finds a marker
refuses to start, naming that run, unless it is gone:
- its heartbeat stopped (older than STALE_S: its node was lost, or it was killed),
  unless its process on this host is stopped (suspended: it goes on when resumed), or
  SLURM says its job still runs or is suspended (`squeue`: a job on another host
  suspended longer than STALE_S, or hung there, would have gone on writing beside the
  new run; a lost node's job ends once SLURM notices, SlurmdTimeout, 300 s by default);
- it ran on this host and its process no longer exists;
- it is an earlier incarnation of this SLURM job (a requeue, an elastic restart's step).
`hpctrain elastic` removes it before each restart: the attempt it belonged to has ended.

File locks were not used: on NFS and Lustre a lock of a lost node can outlive it for
minutes (or until that client reboots), which would refuse an elastic restart. Cost:
one small file and a utime every 20 s on rank 0, whatever the number of ranks; one
`squeue` call by the starting run's rank 0 only when it finds a stale marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from .errors import ConfigError

MARKER = ".hpctrain-running"
HEARTBEAT_S = 20.0
STALE_S = 90.0  # more than four missed heartbeats
EXIT_GRACE_S = 5.0  # a process of this host holding the marker may be exiting
# SLURM job states in which the job's processes may still exist and write
SLURM_HOLDING = ("RUNNING", "SUSPENDED", "COMPLETING", "STOPPED", "SIGNALING")
SQUEUE_TIMEOUT_S = 15.0


class RunMarker:
    """This run's marker and its heartbeat; `release()` when the run is done."""

    def __init__(self, path: Path, text: str, heartbeat_s: float = HEARTBEAT_S):
        self.path, self.text = path, text
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="hpctrain-run-marker", daemon=True
        )
        self._thread.start()

    def _ours(self) -> bool:
        return _read_text(self.path) == self.text

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            if not self._ours():  # taken over (this run hung past STALE_S): leave it
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._ours():
            with contextlib.suppress(OSError):
                self.path.unlink()


def claim(run_dir: str | Path, env=None, now: float | None = None) -> RunMarker:
    """Mark `run_dir` as this run's (rank 0, once the directory exists), or ConfigError
    naming the run that uses it. A gone run's marker is taken over."""
    env = os.environ if env is None else env
    path = Path(run_dir) / MARKER
    text = json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": env.get("SLURM_JOB_ID"),
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
    )
    for _ in range(3):
        if _create_exclusive(path, text):
            return RunMarker(path, text)
        found = _read_text(path)
        if found is None:  # removed meanwhile: try again
            continue
        gone, held = _judge(path, found, env, time.time() if now is None else now)
        if gone is None:
            raise ConfigError(_in_use(Path(run_dir), found, path, held))
        _take_away(path, found)
    raise ConfigError(f"{run_dir}: could not mark it as this run's ({path} kept changing)")


def clear(run_dir: str | Path) -> None:
    """Remove a run's marker: `hpctrain elastic`, once the attempt it belonged to ended."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / MARKER).unlink()


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _holder(text: str) -> dict:
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _judge(path: Path, text: str, env, now: float) -> tuple[str | None, str]:
    """Why the run that wrote `text` no longer uses the directory, or None and how it
    still holds it."""
    try:
        age = now - path.stat().st_mtime
    except OSError:
        return "its marker is gone", ""
    holder, job = _holder(text), env.get("SLURM_JOB_ID")
    here, pid = holder.get("host") == socket.gethostname(), holder.get("pid")
    if age > STALE_S:
        stopped = f"its heartbeat stopped {age:.0f} s ago"
        process = _state(pid) if here else None
        if process == "T":
            return None, f"{stopped}: its process is stopped (suspended), goes on when resumed"
        ended_here = here and process in (None, "Z", "X")
        if ended_here or holder.get("job") == job or not holder.get("job"):
            return stopped, ""
        slurm, unasked = _slurm_state(holder["job"])
        if slurm in SLURM_HOLDING:
            return None, (
                f"{stopped}, but SLURM says its job is {slurm} (suspended, hung, or its "
                f"node lost and not yet noticed), so it could go on writing here; "
                f"`scancel {holder['job']}` ends it"
            )
        if unasked:
            return None, (
                f"{stopped}, and SLURM could not say whether its job still runs "
                f"({unasked}): if it does not, remove {path}"
            )
        return stopped, ""
    fresh = "its heartbeat is fresh"
    if not holder:
        return None, fresh  # being written, or not hpctrain's: wait for STALE_S
    if here and not _alive(pid):
        return f"its process {pid} is gone", ""
    if job and holder.get("job") == job and pid != os.getpid():
        return f"it was an earlier run of SLURM job {job}", ""
    return None, fresh


def _slurm_state(job) -> tuple[str | None, str | None]:
    """SLURM's state of `job` (RUNNING, SUSPENDED, ...; None once SLURM no longer knows
    it: it ended a while ago), and why SLURM could not be asked (None if it was): no
    squeue here, its controller unreachable, no answer within SQUEUE_TIMEOUT_S. A
    suspended job's directory is not given away because its controller did not answer."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None, "no squeue on this host"
    try:
        done = subprocess.run(
            [squeue, "--noheader", "--jobs", str(job), "--format", "%T"],
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, f"squeue did not answer within {SQUEUE_TIMEOUT_S:g} s"
    except OSError as exc:
        return None, f"squeue: {exc}"
    if done.returncode == 0:
        words = done.stdout.split()
        return (words[0] if words else None), None
    if "invalid job id" in done.stderr.lower():  # purged (MinJobAge, 300 s by default)
        return None, None
    said = done.stderr.strip().splitlines()
    line = said[-1] if said else f"exit status {done.returncode}"
    return None, line if line.startswith("squeue") else f"squeue: {line}"


def _alive(pid, grace_s: float = EXIT_GRACE_S) -> bool:
    """Whether process `pid` of this host runs. One that is exiting (a killed rank's
    teardown, a zombie not yet reaped: a job started right after was refused) gets
    `grace_s` to go."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive
            return True
        if _state(pid) in ("Z", "X"):  # exited, waiting for its parent
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def _state(pid) -> str | None:
    """The process state letter of /proc/PID/stat (R, S, D, T, Z, ...); None without
    /proc or such a process."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _take_away(path: Path, judged: str) -> None:
    """Move a gone run's marker aside, only if it is still the one judged (two runs
    taking over at once: the second finds the first's new marker and stops)."""
    aside = path.with_name(f"{MARKER}.gone-{os.getpid()}")
    with contextlib.suppress(OSError):
        os.replace(path, aside)
        if _read_text(aside) != judged:  # another run's fresh marker: put it back
            os.replace(aside, path)
            return
        aside.unlink()


def _in_use(run_dir: Path, text: str, path: Path, held: str) -> str:
    holder = _holder(text)
    if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        return (
            f"{run_dir} is in use by another TrainingLoop of this process that has not "
            f"fitted: fit() it, or close() it first (`with TrainingLoop(...) as loop:` "
            f"closes it at the block's end)"
        )
    who = ", ".join(
        f"{k} {holder[k]}" for k in ("host", "pid", "job", "started") if holder.get(k) is not None
    )
    return (
        f"{run_dir} is in use by another run ({who or 'its marker ' + str(path)}; "
        f"{held}): wait for it to end, or choose another --run-dir. A run that "
        f"was killed leaves {path.name}, which the next run takes over once it is "
        f"{STALE_S:g} s old and SLURM no longer runs its job (at once on the same host)"
    )
