"""The watchdog names the rank holding up a collective, under real mpirun: a rank that
never arrives, a rank stopped (SIGSTOP) inside the collective, the early warning, and
the stall report with every rank's stacks."""

import re

from mpirun import PYTHON, ROOT, mpirun

SCRIPT = str(ROOT / "tests" / "scripts" / "stall_job.py")


def test_a_rank_stopped_inside_the_allreduce_is_named_with_a_report(tmp_path):
    job = mpirun(
        4,
        PYTHON,
        SCRIPT,
        env={"MODE": "stop", "STOP_RANK": "2", "TIMEOUT": "5", "REPORT_DIR": str(tmp_path)},
        timeout=120,
    )
    assert job.returncode != 0
    # entering at ~1 s, deadline at 5 s, named within timeout + 10 s (plus start-up); the
    # deadline covers only this allreduce (stall_job.py); the job took 13.5 s at load 4
    assert job.seconds < 5 + 10 + 20, f"took {job.seconds:.1f} s\n{job.output}"
    assert re.search(
        r"'gradient allreduce' .* within 5 s: rank\(s\) 2 did not answer the liveness probe",
        job.output,
    ), job.output
    assert "every rank arrived" not in job.output
    reports = list(tmp_path.glob("stall-report-*.txt"))
    assert len(reports) == 1, job.output
    text = reports[0].read_text()
    assert "=== rank 2: no answer to the liveness probe ===" in text
    for r in (0, 1, 3):
        block = text.split(f"=== rank {r} on ")[1].split("=== rank")[0]
        assert "'gradient allreduce' entered" in block and "still inside" in block
        assert "Thread 0x" in block and "stall_job.py" in block  # faulthandler's stacks
    assert str(reports[0]) in job.output


def test_a_rank_that_never_arrives_is_named_with_what_it_last_entered(tmp_path):
    job = mpirun(
        4,
        PYTHON,
        SCRIPT,
        env={"MODE": "skip", "SKIP_RANK": "1", "TIMEOUT": "4", "REPORT_DIR": str(tmp_path)},
        timeout=120,
    )
    assert job.returncode != 0
    assert re.search(
        r"'test barrier' .* within 4 s: rank\(s\) 1 never arrived \(rank 1 never arrived, "
        r"it last entered 'warm-up allreduce' \(#\d+, finished\)\)",
        job.output,
    ), job.output
    text = next(tmp_path.glob("stall-report-*.txt")).read_text()
    assert "time.sleep" in text or "main" in text.split("=== rank 1 on ")[1]


def test_early_warning_names_the_missing_rank_before_the_deadline():
    job = mpirun(
        2,
        PYTHON,
        SCRIPT,
        env={"MODE": "skip", "SKIP_RANK": "1", "TIMEOUT": "8", "STALL_WARNING": "2"},
        timeout=120,
    )
    assert job.returncode != 0
    warning = re.search(
        r"WARNING: watchdog: 'test barrier' \(collective #\d+\) has waited 2 s "
        r"\(runtime.stall_warning\): rank\(s\) 1 never arrived",
        job.output,
    )
    assert warning, job.output
    assert job.output.count("WARNING: watchdog") == 1
    assert job.output.index("WARNING: watchdog") < job.output.index("FATAL")


def test_no_warning_in_a_normal_run():
    job = mpirun(
        4,
        PYTHON,
        SCRIPT,
        # the warning under test: the slowest of these 200 steps took 14 ms (load average 4)
        env={"MODE": "normal", "STALL_WARNING": "1", "STEPS": "200"},
        timeout=180,
    )
    assert job.returncode == 0, job.output
    assert "normal run finished: 4" in job.output
    assert "WARNING" not in job.output and "FATAL" not in job.output


def test_a_rank_stopped_during_training_is_named_in_the_gradient_allreduce(tmp_path):
    run = tmp_path / "run"
    sets = [
        "train.allreduce=mpi",
        "train.epochs=100",
        "data.train_samples=512",
        "train.batch_size=16",
        "metrics.tensorboard=false",
        "checkpoint.enabled=false",
    ]
    args = [str(ROOT / "tests" / "scripts" / "stall_train.py"), str(run)]
    for s in sets:
        args += ["--set", s]
    # 6 s from the first step on (the start-up keeps the default: in a healthy run here
    # rank 0 waited 1-2 s for rank 1 in the start-up's 'agree on errors', load average 4)
    job = mpirun(2, PYTHON, *args, env={"STOP_RANK": "1", "TIMEOUT": "6"}, timeout=180)
    assert job.returncode != 0
    assert re.search(
        r"FATAL: watchdog: '[^']+' \(collective #\d+\) did not finish within 6 s: "
        r"rank\(s\) 1 did not answer the liveness probe",
        job.output,
    ), job.output
    report = next(run.glob("stall-report-*.txt")).read_text()
    assert "=== rank 1: no answer to the liveness probe ===" in report
    assert "=== rank 0 on " in report and "still inside" in report
