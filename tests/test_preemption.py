"""Preemption flag logic with real signals sent to this process; requeue targets.

The real `scontrol requeue` against a running job is in tests/test_slurm.py.
"""

import os
import signal

import pytest

from hpctrain.runtime.preemption import Preemption, slurm_job_target


def test_usr1_sets_the_flag_and_nothing_else():
    with Preemption() as pre:
        assert not pre.requested and pre.signal_name is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.requested
        assert pre.signal_name == "SIGUSR1"
        assert pre.seconds_since is not None and pre.seconds_since >= 0


def test_sigterm_is_recorded_instead_of_ending_the_process():
    with Preemption() as pre:
        os.kill(os.getpid(), signal.SIGTERM)
        assert pre.requested and pre.signal_name == "SIGTERM"


def test_the_first_signal_is_the_one_reported():
    with Preemption() as pre:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert pre.signal_name == "SIGUSR1"
        pre.clear()
        assert not pre.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert pre.signal_name == "SIGTERM"


def test_uninstall_restores_the_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        pre = Preemption().install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.requested and seen == []
        pre.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) is not pre._handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_handlers_removed_out_of_order_leave_the_live_ones_and_then_the_first():
    """Two loops of one process: the first closed while the second runs keeps the
    second's handler, and the second then puts back what was there before both."""
    before = signal.getsignal(signal.SIGTERM)
    first = Preemption(signals=(signal.SIGTERM,)).install()
    second = Preemption(signals=(signal.SIGTERM,)).install()
    third = Preemption(signals=(signal.SIGTERM,)).install()
    second.uninstall()  # in the middle
    first.uninstall()  # the oldest
    assert signal.getsignal(signal.SIGTERM) == third._handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert third.requested and not first.requested and not second.requested
    third.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_only_the_chosen_signals_are_handled():
    with Preemption(signals=(signal.SIGUSR2,)) as pre:
        assert signal.getsignal(signal.SIGUSR1) is not pre._handler
        os.kill(os.getpid(), signal.SIGUSR2)
        assert pre.signal_name == "SIGUSR2"


@pytest.mark.parametrize(
    "env, target",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "42"}, "42"),
        ({"SLURM_JOB_ID": "57", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}, "40_3"),
    ],
)
def test_requeue_target_is_the_job_or_the_array_task(env, target):
    assert slurm_job_target(env) == target
    cmd = Preemption(env=env).requeue_command()
    assert cmd == (None if target is None else ["scontrol", "requeue", target])


def test_requeue_is_refused_outside_slurm_and_after_too_many_restarts(capsys):
    assert "not running under SLURM" in Preemption(env={}).requeue_blocker()
    assert Preemption(env={}).requeue() is False
    assert "not requeueing: not running under SLURM" in capsys.readouterr().err
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"}
    assert Preemption(env=env, max_requeues=5).requeue_blocker() is None
    assert "already requeued 3 time(s)" in Preemption(env=env, max_requeues=3).requeue_blocker()
    assert "limit 2" in Preemption(env=env, max_requeues=2).requeue_blocker()
    assert "set runtime.max_requeues" in Preemption(env=env, max_requeues=2).requeue_blocker()
    # the default (runtime.max_requeues' default) allows 10; no environment variable
    assert Preemption(env={**env, "SLURM_RESTART_COUNT": "9"}).requeue_blocker() is None
    assert "limit 10" in Preemption(env={**env, "SLURM_RESTART_COUNT": "10"}).requeue_blocker()


def test_a_failing_scontrol_is_a_warning_not_a_crash(tmp_path, capsys, monkeypatch):
    # A real scontrol that cannot reach any controller (nothing listens on port 9).
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=9\nMessageTimeout=2\n"
        "NodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    if not any(os.access(f"{d}/scontrol", os.X_OK) for d in os.environ["PATH"].split(":")):
        pytest.skip("scontrol is not installed")
    pre = Preemption(env={"SLURM_JOB_ID": "42"})
    assert pre.requeue(timeout=20) is False
    err = capsys.readouterr().err
    assert "`scontrol requeue 42` failed" in err or "did not return" in err, err
