"""Runs stopped by a signal after their first steps (Ctrl-C, kill, mpirun's SIGTERM).

The run must still be training when the signal arrives, whatever the machine's speed:
one epoch of these settings is 6,250 steps, under 4 s on an idle 2-core machine with the
training split in memory, so a single epoch could end before a poller on a busy machine
sees the first steps (it did: fresh clone, 2026-11-27, both mpirun variants finished
their epoch unsignalled). `EPOCHS` makes an unsignalled run last minutes; a signalled
one takes as long as before, so the tests cost nothing more.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from mpirun import DrainedPopen

EPOCHS = 50
# Rank 0's console lines must stay far below a pipe's 64 KiB over the 2 s that Open MPI
# 4.1's mpirun stops reading its ranks' output after a Ctrl-C (it sleeps 1 s before its
# SIGTERM and 1 s before its SIGKILL): at 1,000 steps/s a line per step filled the pipe,
# rank 0 blocked in its write and was killed before its checkpoint (measured, py-spy).
LOG_EVERY = 50
LONG_RUN = [
    "data.train_samples=200000",
    "data.val_samples=64",
    "train.batch_size=16",
    f"train.epochs={EPOCHS}",
    "model.hidden=[16]",
    f"train.log_every={LOG_EVERY}",
    "metrics.tensorboard=false",
]


def sets(*overrides: str) -> list[str]:
    """`--set` arguments for the long run's settings and `overrides`."""
    out = []
    for o in [*LONG_RUN, *overrides]:
        out += ["--set", o]
    return out


def run_env() -> dict:
    """The suite's environment for a run started by hand, without SLURM's variables (a
    SIGTERM under SLURM is a preemption, not an interrupt)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONUNBUFFERED"] = "1"
    for key in [k for k in env if k.startswith("SLURM_")]:
        del env[key]
    return env


def wait_for_steps(metrics: Path, steps: int, proc, timeout: float = 120.0) -> None:
    """Until `steps` step lines are in metrics.jsonl, or an AssertionError naming the exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and sum('"event": "step"' in x for x in metrics.open()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"{steps} steps not reached (exit {proc.poll()})")


def wait_for_start(run: Path, proc, timeout: float = 120.0) -> None:
    """Until the run has made its directory (it still starts: data, model, resume)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if run.is_dir():
            return
        time.sleep(0.02)
    raise AssertionError(f"{run} not made (exit {proc.poll()})")


def stop_after_steps(cmd, run: Path, sig, group: bool, cwd=None, steps=5, timeout=120):
    """Start `cmd`, wait for `steps` steps in metrics.jsonl (0: only for its run
    directory, while it still starts), send `sig` (to the whole process group when
    `group`: what Ctrl-C does), wait for the end; (exit code, output)."""
    proc = DrainedPopen(cmd, env=run_env(), cwd=cwd)  # its own group, as a terminal's job
    try:
        if steps:
            wait_for_steps(run / "metrics.jsonl", steps, proc, timeout)
        else:
            wait_for_start(run, proc, timeout)
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    return proc.returncode, out
