"""The suite's warm ranks (tests/warm_ranks.py) answer as a launch of its own would: the
same exit status and messages for a finished run, a refused one and an abort, and the
next launch after an abort runs on a new job."""

import numpy as np
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun

TINY = ["--set", "train.max_steps=3", "--set", "model.hidden=[16]", "--set", "train.log_every=1"]


def _both(tmp_path, np_, *cmd):
    """(fresh job, warm job) of `cmd`; {RUN} in it becomes a directory of each's own."""
    jobs = []
    for how in ("fresh", "warm"):
        args = [str(tmp_path / how) if c == "{RUN}" else c for c in cmd]
        jobs.append(mpirun(np_, *args, fresh=how == "fresh", timeout=300))
    return jobs


def _weights(run_dir):
    from hpctrain.checkpoint.reader import find_latest_valid

    return find_latest_valid(run_dir / "checkpoints").model_weights()


def test_a_run_ends_the_same_and_trains_the_same_numbers(tmp_path):
    fresh, warm = _both(tmp_path, 2, HPCTRAIN, "train", "--run-dir", "{RUN}", *TINY)
    assert fresh.returncode == warm.returncode == 0, (fresh.output, warm.output)
    for job in (fresh, warm):
        assert "[rank 0/2] INFO done: steps=3" in job.output, job.output
    a, b = _weights(tmp_path / "fresh"), _weights(tmp_path / "warm")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_a_refused_config_exits_2_with_one_message(tmp_path):
    fresh, warm = _both(tmp_path, 2, HPCTRAIN, "train", "--run-dir", "{RUN}",
                        "--set", "model.name=nope")  # fmt: skip
    assert fresh.returncode == warm.returncode == 2
    for job in (fresh, warm):
        assert job.output.count("[rank 0/2] error: rank(s) 0-1: invalid configuration") == 1
        assert "model.name: 'nope' is not a zoo model" in job.output, job.output


def test_an_abort_ends_the_warm_job_as_its_own_launch_and_the_next_launch_runs(tmp_path):
    fresh, warm = _both(tmp_path, 2, PYTHON, str(ROOT / "tests/scripts/raise_on_rank.py"))
    assert fresh.returncode != 0 and warm.returncode != 0
    for job in (fresh, warm):
        assert job.output.count("RuntimeError: boom from rank 1") == 1, job.output
        assert "[rank 1/2] FATAL" in job.output
    after = mpirun(2, HPCTRAIN, "train", "--run-dir", str(tmp_path / "after"), *TINY)
    assert after.returncode == 0, after.output
