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


def test_a_gone_runs_marker_is_taken_over(tmp_path):
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
