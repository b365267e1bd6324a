"""How many compute threads each rank should use.

Oversubscribed ranks that each start one thread per core thrash: 4 ranks x 2 threads on
2 cores runs several times slower than 4 x 1. The launcher usually knows the right
number (SLURM_CPUS_PER_TASK, OMP_NUM_THREADS); otherwise the node's cores are divided
among the ranks on it.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_size: int, env: dict | None = None) -> tuple[int, str]:
    """(threads, where the number came from) for one of `local_size` ranks on a node."""
    env = os.environ if env is None else env
    for var in ("HPCTRAIN_THREADS", "SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value), var
    # Open MPI binds each rank to a core when ranks <= cores, so affinity already says 1;
    # count the node's cores instead of trusting a per-rank affinity mask.
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size)), f"{cores} cores / {local_size} local ranks"
