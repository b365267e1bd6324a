"""How many compute threads each rank should use.

Oversubscribed ranks that each start one thread per core thrash: 4 ranks x 2 threads on
2 cores runs several times slower than 4 x 1. The launcher usually knows the right
number (SLURM_CPUS_PER_TASK, OMP_NUM_THREADS); otherwise the node's cores are divided
among the ranks on it. The node's cores are os.cpu_count(), unless the node says
otherwise: HPCTRAIN_NODE_CORES (an emulated node, `hpctrain cluster`, whose cpuset holds
part of the machine) or SLURM_CPUS_ON_NODE (the cores of this job on the node).
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
    ignored: list[str] = []  # set, but not a count: said where the number is shown

    def count(var: str) -> int | None:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
        if value.strip():
            ignored.append(f"{var}={value!r}")
        return None

    for var in ("HPCTRAIN_THREADS", "SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        if (threads := count(var)) is not None:
            return threads, var + _ignored(ignored)
    # Open MPI binds each rank to a core when ranks <= cores, so affinity already says 1;
    # count the node's cores instead of trusting a per-rank affinity mask.
    cores = os.cpu_count() or 1
    for var in ("HPCTRAIN_NODE_CORES", "SLURM_CPUS_ON_NODE"):
        if (found := count(var)) is not None:
            cores = found
            break
    where = f"{cores} cores / {local_size} local ranks" + _ignored(ignored)
    return max(1, cores // max(1, local_size)), where


def _ignored(ignored: list[str]) -> str:
    return f"; ignored, not a positive whole number: {', '.join(ignored)}" if ignored else ""


def limit_blas_threads(threads: int) -> None:
    """Hold numpy's BLAS (OpenBLAS) to the rank's threads, as torch and TF are held.

    Why: OpenBLAS starts one spinning thread per core in every rank. PowerSGD's numpy
    products on 2 ranks x 2 BLAS threads over 2 cores took 100 ms a step, 12 ms with
    one thread each (measured 2026-11-26, mlp, one node)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=max(1, int(threads)), user_api="blas")
