"""Which stops the user asked for (an interrupt) and which a scheduler did (requeue them).

One rule for the ranks (runtime/preemption.py) and for `hpctrain elastic`'s supervisor,
which passes a stop on to its ranks and may not import the runtime: SIGINT (Ctrl-C) and
SIGUSR2 are the user's; SIGTERM is the user's outside SLURM (no SLURM_JOB_ID: mpirun
passes Ctrl-C on as SIGTERM, and nothing can requeue) and a scheduler's inside it
(scancel or a preemption); SIGUSR1 is the scheduler's warning.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = ("SIGUSR1", "SIGUSR2")  # stop and checkpoint, exit 0 (mpirun forwards both)


def interrupt_reason(signal_name: str | None, env: dict | os._Environ | None = None) -> str | None:
    """Why a stop on `signal_name` was asked for by the user (an interrupt), or None when
    it is a scheduler's (preemption, time limit: requeue it).

    SIGINT is Ctrl-C. A SIGTERM outside SLURM is a stop request: mpirun passes Ctrl-C (and
    a kill of mpirun) on to its ranks as SIGTERM, and there is no scheduler to requeue for.
    """
    env = os.environ if env is None else env
    if signal_name == "SIGINT":
        return "Ctrl-C"
    if signal_name == "SIGUSR2":
        return "SIGUSR2, a stop without requeue"
    if signal_name == "SIGTERM" and not env.get("SLURM_JOB_ID"):
        if env.get("OMPI_COMM_WORLD_SIZE"):
            # Open MPI's mpirun exits 1 after Ctrl-C (its own abort status), whatever the
            # ranks return, and SIGKILLs ranks still running about a second later.
            return "Ctrl-C or a kill of mpirun, which passes both on as SIGTERM; mpirun exits 1"
        return "SIGTERM outside SLURM, a stop request"
    return None


def interrupt_exit_code(signal_name: str | None, env: dict | os._Environ | None = None) -> int:
    """The exit status after a clean stop on `signal_name`: 128 + its number for an
    interrupt (130 for Ctrl-C, as a shell reports a program ended by SIGINT), else 0
    (a preemption that was checkpointed and requeued, or a SIGUSR1/SIGUSR2 stop, finished
    its part)."""
    if signal_name in STOP_SIGNALS:
        return 0
    if signal_name and interrupt_reason(signal_name, env) is not None:
        return 128 + int(signal.Signals[signal_name])
    return 0
