"""The runtime layer under real mpirun jobs: fail-together, watchdog, doctor, launch checks."""

import platform
import re

import pytest
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun

SCRIPTS = ROOT / "tests" / "scripts"


def test_exception_on_one_rank_ends_the_job_quickly_with_its_message():
    job = mpirun(2, PYTHON, str(SCRIPTS / "raise_on_rank.py"), env={"RAISE_RANK": "1"}, timeout=120)
    assert job.returncode != 0
    assert job.seconds < 30, f"took {job.seconds:.1f} s"
    assert job.output.count("RuntimeError: boom from rank 1") == 1, job.output
    assert "[rank 1/2] FATAL" in job.output


def test_a_user_error_on_rank_zero_alone_ends_all_four_ranks_with_status_3():
    """One line, no traceback; status 3, not an agreed error's 2, so that `hpctrain
    elastic` restarts it (an unreadable file on one node may be readable again)."""
    env = {"RAISE_RANK": "0", "RAISE_KIND": "user"}
    job = mpirun(4, PYTHON, str(SCRIPTS / "raise_on_rank.py"), env=env, timeout=120)
    assert job.returncode == 3, job.output
    assert job.seconds < 30, f"took {job.seconds:.1f} s"
    assert job.output.count("FATAL: error: cannot read shard.h5 on rank 0") == 1, job.output
    assert "Traceback" not in job.output, job.output


def test_doctor_shows_four_ranks_and_both_frameworks():
    job = mpirun(4, HPCTRAIN, "doctor", timeout=240)
    assert job.returncode == 0, job.output
    assert "4 rank(s)" in job.output
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+4\s+0\s+\S+$", job.output, re.M)
    assert sorted(rows) == [(str(r), str(r)) for r in range(4)], job.output
    for piece in (
        "torch",
        "tensorflow",
        "horovod[torch]",
        "horovod[tensorflow]",
        "mpi4py",
        "h5py",
        "Open MPI",
    ):
        assert piece in job.output, piece
    assert "MPI, Gloo" in job.output
    assert "doctor: all checks passed" in job.output


# `make test-extended` (11 s: two fresh launches, doctor importing every framework):
# `make test` has the same broken package on one of two emulated nodes, where doctor
# and train must also name the node (test_multinode.py).
@pytest.mark.extended
def test_a_missing_package_is_named_by_doctor_and_refuses_train_in_one_line(tmp_path):
    """h5py unimportable on every rank (a broken install): `doctor` still runs and names
    it with the node; `train` stops with one line, said once (by the node's first rank), never a traceback."""
    (tmp_path / "h5py.py").write_text('raise ImportError("h5py is broken here")\n')
    env = {"PYTHONPATH": str(tmp_path)}
    job = mpirun(2, HPCTRAIN, "doctor", "--quiet", env=env, fresh=True, timeout=240)
    assert job.returncode == 1, job.output
    assert re.search(r"^doctor: MISSING: h5py \(on \S+\)$", job.output, re.M), job.output
    assert "Traceback" not in job.output, job.output
    job = mpirun(2, HPCTRAIN, "train", env=env, fresh=True, timeout=120)
    assert job.returncode != 0, job.output
    line = "is incomplete: cannot import hpctrain.checkpoint.cli (ImportError: h5py"
    assert job.output.count(line) == 1 and "Traceback" not in job.output, job.output
    assert f"the install on {platform.node()} is incomplete" in job.output, job.output


def test_launcher_variables_that_disagree_with_mpi_are_refused():
    # Simulate a broken launch: every rank told it is rank 0 by a stale variable.
    job = mpirun(2, "-x", "HOROVOD_RANK=0", "-x", "HOROVOD_SIZE=2", HPCTRAIN, "doctor", timeout=120)
    assert job.returncode == 2, job.output
    assert "launcher variables disagree with MPI" in job.output
    assert "HOROVOD_RANK=0 (horovodrun) but MPI says rank=1" in job.output
    assert job.output.count("error: ") == 1  # agreed by every rank, said once by rank 0


def test_invalid_config_is_reported_on_every_rank_before_work():
    job = mpirun(
        2, HPCTRAIN, "train", "--set", "train.batch_size=0", "--set", "optimizr.lr=1", timeout=120
    )
    assert job.returncode == 2, job.output
    assert "[rank 0/2] error: " in job.output and "[rank 1/2] error: " not in job.output
    assert job.output.count("train.batch_size: must be >= 1, got 0") == 1
    assert job.output.count("optimizr: unknown key") == 1


def test_gloo_style_launch_without_mpi_is_explained():
    import os
    import subprocess

    env = dict(
        os.environ,
        HOROVOD_RANK="0",
        HOROVOD_SIZE="2",
        HOROVOD_LOCAL_RANK="0",
        HOROVOD_LOCAL_SIZE="2",
    )
    job = subprocess.run([HPCTRAIN, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 2
    assert "each one is a separate MPI job of size 1" in job.stderr
    assert "horovodrun without --gloo" in job.stderr
