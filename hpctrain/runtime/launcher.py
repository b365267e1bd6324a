"""What the launcher (mpirun, srun, horovodrun, hydra) says about this process.

Launchers export rank variables before the process starts; MPI is the authority, and
these are cross-checked against it so that a broken launch (e.g. an sbatch script that
runs one launcher per task, or a stale SLURM_PROCID inherited from the batch shell)
fails with a clear message instead of training the wrong shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# (launcher, {field: variable}) in order of precedence. Fields: rank, size, local_rank,
# local_size, node.
_SCHEMES: list[tuple[str, dict[str, str]]] = [
    (
        "mpirun (Open MPI)",
        {
            "rank": "OMPI_COMM_WORLD_RANK",
            "size": "OMPI_COMM_WORLD_SIZE",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "local_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        },
    ),
    (
        "srun (SLURM)",
        {
            "rank": "SLURM_PROCID",
            "size": "SLURM_STEP_NUM_TASKS",
            "local_rank": "SLURM_LOCALID",
            "node": "SLURM_NODEID",
        },
    ),
    (
        "horovodrun",
        {
            "rank": "HOROVOD_RANK",
            "size": "HOROVOD_SIZE",
            "local_rank": "HOROVOD_LOCAL_RANK",
            "local_size": "HOROVOD_LOCAL_SIZE",
        },
    ),
    ("hydra (MPICH)", {"rank": "PMI_RANK", "size": "PMI_SIZE"}),
]


@dataclass(frozen=True)
class LauncherView:
    """Rank information one launcher exported, as integers."""

    name: str
    values: dict[str, int] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)


def _pmi_is_sruns(env: os._Environ | dict) -> bool:
    """True when PMI_RANK/PMI_SIZE were set by srun's own PMI-2 plugin (`--mpi=pmi2`).

    srun then also sets PMI_JOBID=<job id>.<step id>; MPICH's hydra, whose proxies run
    as srun tasks inside an allocation, sets PMI_RANK but not that PMI_JOBID.
    """
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID")
    return bool(job and step) and env.get("PMI_JOBID") == f"{job}.{step}"


def _slurm_step_is_ours(env: os._Environ | dict) -> bool:
    """True when SLURM_* describe this process's own srun step.

    Inside an sbatch script the batch shell exports SLURM_PROCID=0 and SLURM_NTASKS for
    the whole allocation; mpirun started from it passes those on to every rank, and Open
    MPI's daemons are themselves srun tasks (one per node). Only a direct `srun` launch,
    with no Open MPI, Horovod or hydra variables (PMI_* set by srun itself are fine),
    makes SLURM_PROCID the MPI rank.
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return False
    if any(k in env for k in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK")):
        return False
    return "PMI_RANK" not in env or _pmi_is_sruns(env)


def launcher_views(env: os._Environ | dict | None = None) -> list[LauncherView]:
    """Every launcher whose rank variables are present (and trustworthy) in `env`."""
    env = os.environ if env is None else env
    views = []
    for name, mapping in _SCHEMES:
        if name.startswith("srun") and not _slurm_step_is_ours(env):
            continue
        if name.startswith("hydra") and _pmi_is_sruns(env):
            continue  # srun --mpi=pmi2 sets PMI_*: the srun view above already has them
        if mapping["rank"] not in env:
            continue
        values, variables = {}, {}
        for key, var in mapping.items():
            if var in env:
                try:
                    values[key] = int(env[var])
                except ValueError as exc:
                    raise ValueError(f"{var}={env[var]!r} is not an integer") from exc
                variables[key] = var
        views.append(LauncherView(name, values, variables))
    return views


def disagreements(mpi: dict[str, int], views: list[LauncherView]) -> list[str]:
    """Human-readable mismatches between MPI's layout and each launcher's variables."""
    problems = []
    for view in views:
        for key, value in view.values.items():
            if key in mpi and mpi[key] != value:
                problems.append(
                    f"{view.variables[key]}={value} ({view.name}) but MPI says {key}={mpi[key]}"
                )
    return problems


def launcher_name(views: list[LauncherView]) -> str:
    """The most specific launcher that started this process, or 'singleton'."""
    return views[0].name if views else "singleton"
