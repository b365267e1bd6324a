"""One run at a time in a run directory (run_marker.py): a second run is refused while
the first's heartbeat is fresh, and takes over the marker of a run that is gone."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpctrain import run_marker
from hpctrain.errors import ConfigError
from hpctrain.run_marker import MARKER, STALE_S, RunMarker, claim


def _write(run, **holder):
    (run / MARKER).write_text(json.dumps(holder))


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A `squeue` first on PATH: `state(text)` sets what it prints (None: it knows no
    such job, as SLURM says of a job gone a while; `fail(text)`: an error of its own);
    `calls` lists its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    said, calls, fails = bin_dir / "said", bin_dir / "calls", bin_dir / "fails"

    class Squeue:
        def state(self, text):
            said.write_text(text or "")
            fails.unlink(missing_ok=True)

        def fail(self, text):
            fails.write_text(text)

        def calls(self):
            return calls.read_text().splitlines() if calls.exists() else []

    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n[ -e {fails} ] && {{ cat {fails} >&2; exit 1; }}\n'
        f"[ -s {said} ] || "
        f'{{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}\n'
        f"cat {said}\n"
    )
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    fake = Squeue()
    fake.state(None)
    return fake


def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path):
    _write(tmp_path, host="node7", pid=123)  # fresh, another node's (here: 5 s of grace)
    with pytest.raises(ConfigError, match=f"{tmp_path} is in use by another run \\(host "):
        claim(tmp_path, env={})
    (tmp_path / MARKER).unlink()
    first = claim(tmp_path, env={})  # this process's: an unfitted TrainingLoop's
    with pytest.raises(ConfigError, match="another TrainingLoop of this process .* close\\(\\)"):
        claim(tmp_path, env={})
    first.release()
    assert not (tmp_path / MARKER).exists()
    claim(tmp_path, env={}).release()


def test_a_gone_runs_marker_is_taken_over(tmp_path, squeue):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    import socket

    here = socket.gethostname()
    _write(tmp_path, host=here, pid=int(done.stdout))  # killed on this host
    claim(tmp_path, env={}).release()
    # killed, not yet reaped (a zombie): a warm test rank's job was refused the next run
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    while run_marker._state(exited.pid) not in ("Z", None):
        time.sleep(0.05)
    _write(tmp_path, host=here, pid=exited.pid)
    claim(tmp_path, env={}).release()
    exited.wait()
    _write(tmp_path, host="node7", pid=123, job="42")  # a lost node: heartbeat stopped
    old = time.time() - STALE_S - 5
    os.utime(tmp_path / MARKER, (old, old))
    claim(tmp_path, env={}).release()
    _write(tmp_path, host="node7", pid=123, job="42")  # fresh, on another node: in use
    with pytest.raises(ConfigError, match="host node7, pid 123, job 42"):
        claim(tmp_path, env={})
    claim(tmp_path, env={"SLURM_JOB_ID": "42"}).release()  # this job's earlier run
    _write(tmp_path, host="node7", pid=123, job="42")
    run_marker.clear(tmp_path)  # hpctrain elastic, before a restart
    claim(tmp_path, env={}).release()


def test_a_suspended_runs_stale_marker_on_this_host_is_not_taken_over(tmp_path):
    """`scontrol suspend` stops a run's processes, its heartbeat with them: after STALE_S
    a run started in its directory took it over, and both wrote there once it resumed."""
    import socket

    held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(held.pid, signal.SIGSTOP)
        while run_marker._state(held.pid) != "T":
            time.sleep(0.05)
        _write(tmp_path, host=socket.gethostname(), pid=held.pid)
        old = time.time() - STALE_S - 5
        os.utime(tmp_path / MARKER, (old, old))
        with pytest.raises(ConfigError, match=f"pid {held.pid}"):
            claim(tmp_path, env={})
        os.kill(held.pid, signal.SIGCONT)  # running again, its marker still stale: gone
        while run_marker._state(held.pid) == "T":
            time.sleep(0.05)
        claim(tmp_path, env={}).release()
    finally:
        held.kill()
        held.wait()


def test_the_heartbeat_renews_the_marker_until_released(tmp_path):
    path = tmp_path / MARKER
    path.write_text("ours")
    os.utime(path, (1, 1))
    marker = RunMarker(path, "ours", heartbeat_s=0.05)
    deadline = time.monotonic() + 10
    while path.stat().st_mtime < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.stat().st_mtime > time.time() - 60
    path.write_text("another run's")  # taken over: left alone, not removed
    marker.release()
    assert path.read_text() == "another run's"


def test_a_stale_marker_of_a_job_slurm_still_runs_is_not_taken_over(tmp_path, squeue):
    """A run suspended on another host (`scontrol suspend`, longer than STALE_S) kept no
    heartbeat, and a run started elsewhere took its directory over: both wrote there
    once it resumed. SLURM knows it is suspended (test_slurm.py asks a real one)."""
    run = tmp_path / "run"
    run.mkdir()
    old = time.time() - STALE_S - 5
    for state in ("SUSPENDED", "RUNNING"):
        squeue.state(state)
        _write(run, host="node7", pid=123, job="4242")
        os.utime(run / MARKER, (old, old))
        with pytest.raises(ConfigError) as refused:
            claim(run, env={"SLURM_JOB_ID": "77"})
        said = str(refused.value)
        assert "host node7, pid 123, job 4242" in said and f"its job is {state}" in said
        assert "`scancel 4242` ends it" in said
    assert squeue.calls() == ["--noheader --jobs 4242 --format %T"] * 2
    squeue.state("COMPLETED")  # ended, still in SLURM's memory
    claim(run, env={}).release()
    _write(run, host="node7", pid=123, job="4242")
    os.utime(run / MARKER, (old, old))
    squeue.state(None)  # gone from it
    claim(run, env={}).release()
    _write(run, host="node7", pid=123, job="4242")
    os.utime(run / MARKER, (old, old))
    squeue.state("RUNNING")  # this job itself, requeued: its earlier run's, not asked
    claim(run, env={"SLURM_JOB_ID": "4242"}).release()
    assert len(squeue.calls()) == 4


def test_a_stale_marker_is_kept_when_slurm_cannot_say_its_job_ended(tmp_path, squeue, monkeypatch):
    """A controller that does not answer (or no squeue on this host) is not a job gone:
    the directory stays the suspended run's, and the message says how to free it."""
    _write(tmp_path, host="node7", pid=123, job="4242")
    old = time.time() - STALE_S - 5
    os.utime(tmp_path / MARKER, (old, old))
    squeue.fail("squeue: error: Unable to contact slurm controller (connect failure)")
    with pytest.raises(ConfigError) as refused:
        claim(tmp_path, env={})
    said = str(refused.value)
    assert "SLURM could not say whether its job still runs (squeue: error: Unable to " in said
    assert f"if it does not, remove {tmp_path / MARKER}" in said
    monkeypatch.setattr(run_marker.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="no squeue on this host"):
        claim(tmp_path, env={})
    _write(tmp_path, host="node7", pid=123)  # no SLURM job named: nothing to ask
    os.utime(tmp_path / MARKER, (old, old))
    claim(tmp_path, env={}).release()
