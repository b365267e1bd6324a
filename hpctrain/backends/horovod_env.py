"""Horovod's knobs from the config, as the HOROVOD_* variables users already know.

Framework-free on purpose: both backends call `apply_horovod_env` before `hvd.init`.
"""

from __future__ import annotations

import os

from ..errors import LaunchError

GLOO_SWITCHES = ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")
# the `horovod:` section's defaults (config.py's schema takes them from here)
DEFAULTS = {
    "fusion_threshold_mb": 64,
    "cycle_time_ms": 1.0,
    "hierarchical_allreduce": False,
    "timeline": None,
    "autotune": False,
}


def keys_set(hcfg: dict) -> list[str]:
    """The horovod.* settings other than their defaults, as "horovod.key=value": said
    where another engine averages the gradients, since they then do nothing."""
    return [f"horovod.{k}={v}" for k, v in hcfg.items() if k in DEFAULTS and v != DEFAULTS[k]]


def init_process_sets(hvd, comm, groups: list[list[int]], mine: int):
    """Horovod (`hvd`: horovod.torch or horovod.tensorflow) with one process set per
    pipeline stage (the ranks holding that stage); returns (hvd, this rank's set).

    Horovod 0.28.1 registers static process sets at `hvd.init(process_sets=...)`, which
    every rank must call with the same list; collectives then take `process_set=`.
    """
    if hvd.is_initialized():
        raise RuntimeError("Horovod is already initialised; the pipeline needs its own init")
    if len(groups) == 1:
        hvd.init(comm=comm)
        return hvd, hvd.global_process_set
    sets = [hvd.ProcessSet(g) for g in groups]
    hvd.init(comm=comm, process_sets=sets)
    return hvd, sets[mine]


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
