"""Preemption: notice SLURM's warning signal, and requeue the job once it is handled.

SLURM sends SIGUSR1 (`--signal=USR1@90` in the templates) some time before the time
limit and SIGTERM on preemption or scancel. A signal arrives at an arbitrary point of
one rank, possibly inside an MPI call, so the handler here only records it. The
trainer polls `requested` once per step, agrees on it across ranks through its
per-step allreduce (so every rank stops at the same step), checkpoints, writes the run's
summary, and then rank 0 calls `requeue()` as its last act (SLURM ends the running job at
once): `scontrol requeue` puts the job back in the queue under the same id, and the new
run resumes from the checkpoint in the same run directory.

An interrupt is not a preemption. Ctrl-C reaches a process started without a launcher as
SIGINT; Open MPI's mpirun passes it on to its ranks as SIGTERM (as it does its own
SIGTERM). Either way it is handled as above, but it is a stop the user asked for: never
requeued, said as an interrupt, and `hpctrain train` exits 128 + the signal's number
(130 for SIGINT, 143 for SIGTERM; `interrupt_exit_code`). A SIGTERM counts as an
interrupt only outside SLURM (no SLURM_JOB_ID); under SLURM it is scancel or a
preemption and the job is requeued. A second Ctrl-C ends the process at once, as
Python's default does.

SIGUSR2 is a stop without requeue that a launcher passes on untouched (mpirun ends its
ranks 1 s after a SIGINT or SIGTERM of its own; SIGUSR1 and SIGUSR2 it forwards and
waits): `kill -USR2 <mpirun's pid>`, or `hpctrain elastic` passing on a Ctrl-C. It is
never requeued, even under SLURM, and exits 0 like SIGUSR1: the stop asked for is done.

Nothing here imports MPI or a framework.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..stop_signals import STOP_SIGNALS, interrupt_exit_code, interrupt_reason

__all__ = ["STOP_SIGNALS", "Preemption", "interrupt_exit_code", "interrupt_reason"]

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
DEFAULT_MAX_REQUEUES = 10  # runtime.max_requeues; a loop of failures stops here
SCONTROL_TIMEOUT_S = 30


def slurm_job_target(env: dict | os._Environ | None = None) -> str | None:
    """The id `scontrol requeue` needs: JOBID, or ARRAYJOBID_TASKID inside an array job.

    An array task has its own SLURM_JOB_ID too, but requeueing by the array form is
    what works on every SLURM version (and what Lightning and submitit use).
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return job


class Preemption:
    """Records SIGUSR1/SIGTERM; `requeue()` asks SLURM to run the job again.

        pre = Preemption().install()
        ...  # in the loop: if world.any_flag(pre.requested): checkpoint, pre.requeue(), stop
        pre.uninstall()

    A signal while a handler is installed no longer ends the process: the owner must
    poll `requested`. SLURM still sends SIGKILL after its KillWait (30 s by default)
    when a SIGTERM is ignored, so a stuck process cannot outlive its job.
    """

    def __init__(
        self,
        signals: tuple[int, ...] = DEFAULT_SIGNALS,
        env: dict | None = None,
        max_requeues: int | None = None,
    ):
        self.signals = tuple(signals)
        self.env = os.environ if env is None else env
        self.max_requeues = DEFAULT_MAX_REQUEUES if max_requeues is None else int(max_requeues)
        self._signum: int | None = None
        self._received_at: float | None = None
        self._previous: dict[int, object] = {}

    # --- signals -----------------------------------------------------------------------
    def _handler(self, signum, frame) -> None:
        # Only assignments: no I/O, no locks, nothing that may be mid-use in the main code.
        if self._signum is None:
            self._signum = signum
            self._received_at = time.monotonic()
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def install(self) -> Preemption:
        """Install the handlers (main thread only); returns self."""
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        """Put back whatever handlers were there before `install()`, except where a later
        Preemption installed its own (two loops of one process, the first one closed)."""
        for sig, previous in self._previous.items():
            later = getattr(signal.getsignal(sig), "__self__", None)
            if isinstance(later, Preemption) and later is not self:
                later._forget(sig, self, previous)  # it puts back what we replaced
            else:
                signal.signal(sig, previous)
        self._previous.clear()

    def _forget(self, sig: int, gone: Preemption, previous) -> None:
        """Where `gone`'s handler is what this one (or an earlier one) replaced, replace
        `previous` instead: handlers of Preemptions removed out of order."""
        owner = getattr(self._previous.get(sig), "__self__", None)
        if owner is gone:
            self._previous[sig] = previous
        elif isinstance(owner, Preemption):
            owner._forget(sig, gone, previous)

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def requested(self) -> bool:
        """True once one of the signals has arrived."""
        return self._signum is not None

    @property
    def signal_name(self) -> str | None:
        """'SIGUSR1', 'SIGTERM', ... for the first signal received, else None."""
        return None if self._signum is None else signal.Signals(self._signum).name

    @property
    def seconds_since(self) -> float | None:
        """Seconds since the first signal (how much of SLURM's warning is used up)."""
        return None if self._received_at is None else time.monotonic() - self._received_at

    def clear(self) -> None:
        self._signum = self._received_at = None

    # --- requeue -------------------------------------------------------------------------
    def requeue_command(self) -> list[str] | None:
        """`scontrol requeue <job>` for this job, or None outside SLURM."""
        target = slurm_job_target(self.env)
        return None if target is None else ["scontrol", "requeue", target]

    def requeue_blocker(self) -> str | None:
        """Why this job must not be requeued (None when it may be)."""
        if self._signum is not None:
            why = interrupt_reason(self.signal_name, self.env)
            if why is not None:
                return f"interrupted ({why}); continue later with --resume auto"
        if not self.env.get("SLURM_JOB_ID"):
            return "not running under SLURM (SLURM_JOB_ID is not set)"
        restarts = int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)
        if restarts >= self.max_requeues:
            return (
                f"the job was already requeued {restarts} time(s) "
                f"(limit {self.max_requeues}, set runtime.max_requeues to change it)"
            )
        return None

    def requeue(self, timeout: float = SCONTROL_TIMEOUT_S) -> bool:
        """Requeue this SLURM job (call on one rank, after the checkpoint is on disk).

        Returns True when scontrol accepted it; otherwise prints why on stderr and
        returns False (the caller then simply ends; the checkpoint is kept).
        """
        blocker = self.requeue_blocker()
        if blocker is not None:
            _warn(f"not requeueing: {blocker}")
            return False
        cmd = self.requeue_command()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            _warn("cannot requeue: scontrol is not on PATH; resubmit the job by hand")
            return False
        except subprocess.TimeoutExpired:
            _warn(f"cannot requeue: `{' '.join(cmd)}` did not return within {timeout:g} s")
            return False
        if proc.returncode != 0:
            detail = (proc.stderr.strip() or proc.stdout.strip() or "no message").splitlines()[-1]
            hint = " (the job was submitted without --requeue)" if "disabled" in detail else ""
            _warn(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {detail}{hint}; "
                "resubmit the job by hand to continue from its checkpoint"
            )
            return False
        return True


def _warn(message: str) -> None:
    sys.stderr.write(f"[hpctrain] warning: {message}\n")
    sys.stderr.flush()
