"""Horovod's knobs from the config, as the HOROVOD_* variables users already know.

Framework-free on purpose: both backends call `apply_horovod_env` before `hvd.init`.
"""

from __future__ import annotations

import os

from ..errors import LaunchError

GLOO_SWITCHES = ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")


def horovod_env(hcfg: dict) -> dict[str, str]:
    """HOROVOD_* settings for a `horovod:` config section (explicit env vars win)."""
    env = {
        "HOROVOD_FUSION_THRESHOLD": str(int(hcfg["fusion_threshold_mb"] * 1024 * 1024)),
        "HOROVOD_CYCLE_TIME": f"{hcfg['cycle_time_ms']:g}",
    }
    if hcfg["hierarchical_allreduce"]:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    if hcfg["timeline"]:
        env["HOROVOD_TIMELINE"] = str(hcfg["timeline"])
    if hcfg["autotune"]:
        env["HOROVOD_AUTOTUNE"] = "1"
    return env


def apply_horovod_env(hcfg: dict | None, stall_seconds: float | None = None) -> dict[str, str]:
    """Export the settings (without overriding what the user exported) and return them."""
    refuse_gloo()
    env = horovod_env(hcfg) if hcfg else {}
    if stall_seconds:
        # Horovod's own stall inspector names the ranks missing from a collective; make it
        # warn early and shut the job down at the same deadline as hpctrain's watchdog.
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(int(max(5, min(60, stall_seconds / 2))))
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(int(stall_seconds))
    applied = {}
    for key, value in env.items():
        applied[key] = os.environ.setdefault(key, value)
    return applied


def refuse_gloo() -> None:
    """Stop before `hvd.init` when the environment asks Horovod for Gloo.

    hpctrain hands Horovod its MPI communicator; with HOROVOD_CONTROLLER or
    HOROVOD_CPU_OPERATIONS set to gloo under mpirun or srun there is no Gloo rendezvous,
    and Horovod aborts, crashes or silently trains each rank alone (size 1).
    """
    chosen = [f"{k}={os.environ[k]}" for k in GLOO_SWITCHES if os.environ.get(k, "") == "gloo"]
    if chosen:
        raise LaunchError(
            f"{' and '.join(chosen)} is set, but hpctrain runs Horovod over MPI (the "
            "communicator it shares with mpi4py); Gloo mode has no rendezvous here and "
            "would abort, crash or train every rank alone. Unset it (or set it to mpi)."
        )
