"""Launcher variables are read correctly, and stale SLURM variables are not trusted."""

import pytest

from hpctrain.backends.horovod_env import apply_horovod_env
from hpctrain.errors import LaunchError
from hpctrain.runtime.launcher import disagreements, launcher_name, launcher_views
from hpctrain.runtime.threads import threads_per_rank


def test_open_mpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    views = launcher_views(env)
    assert launcher_name(views) == "mpirun (Open MPI)"
    assert views[0].values == {"rank": 3, "size": 4, "local_rank": 1, "local_size": 2}
    assert disagreements({"rank": 3, "size": 4, "local_rank": 1, "local_size": 2}, views) == []
    assert disagreements({"rank": 2, "size": 4}, views) == [
        "OMPI_COMM_WORLD_RANK=3 (mpirun (Open MPI)) but MPI says rank=2"
    ]


def test_srun_step_variables_are_checked():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
    }
    views = launcher_views(env)
    assert launcher_name(views) == "srun (SLURM)"
    assert views[0].values == {"rank": 5, "size": 8, "local_rank": 1, "node": 2}


def test_batch_shell_slurm_variables_under_mpirun_are_ignored():
    # mpirun inside sbatch: SLURM_PROCID is the batch shell's (or an orted's), not ours.
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
    }
    assert [v.name for v in launcher_views(env)] == ["mpirun (Open MPI)"]
    # In the batch shell itself there is no step id: not a launch of ours.
    assert launcher_views({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}) == []


def test_threads_come_from_the_launcher_or_the_cores():
    assert threads_per_rank(4, {"SLURM_CPUS_PER_TASK": "6"}) == (6, "SLURM_CPUS_PER_TASK")
    assert threads_per_rank(4, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    # A node smaller than the machine (an emulated node's cpuset, a SLURM allocation).
    assert threads_per_rank(1, {"HPCTRAIN_NODE_CORES": "1"}) == (1, "1 cores / 1 local ranks")
    assert threads_per_rank(2, {"SLURM_CPUS_ON_NODE": "8"}) == (4, "8 cores / 2 local ranks")
    n, why = threads_per_rank(10**6, {})
    assert n == 1 and "local ranks" in why
    # set but not a count: passed over, and said so where the number is shown
    n, why = threads_per_rank(2, {"HPCTRAIN_THREADS": "abc", "OMP_NUM_THREADS": "0",
                                  "SLURM_CPUS_ON_NODE": "8"})  # fmt: skip
    assert n == 4 and why == (
        "8 cores / 2 local ranks; ignored, not a positive whole number: "
        "HPCTRAIN_THREADS='abc', OMP_NUM_THREADS='0'"
    )


def test_horovod_gloo_switches_are_refused_before_hvd_init(monkeypatch):
    for key in ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"):
        monkeypatch.delenv("HOROVOD_CONTROLLER", raising=False)
        monkeypatch.delenv("HOROVOD_CPU_OPERATIONS", raising=False)
        monkeypatch.setenv(key, "gloo")
        with pytest.raises(LaunchError, match=f"{key}=gloo is set"):
            apply_horovod_env(None)
        monkeypatch.setenv(key, "mpi")
        assert apply_horovod_env(None) == {}
