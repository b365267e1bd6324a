"""Ctrl-C: the first one asks for a checkpoint and a clean stop, a second one interrupts.

The same under mpirun and without it: tests/test_first_hour.py sends SIGINT to real jobs.
"""

import os
import signal

import pytest

from hpctrain.runtime.preemption import Preemption


def test_ctrl_c_asks_for_a_checkpoint_once_and_a_second_one_interrupts():
    # What was there before (Python's default_int_handler; SIG_IGN when the test runner
    # itself was started in the background) comes back afterwards.
    before = signal.getsignal(signal.SIGINT)
    with Preemption(env={"SLURM_JOB_ID": "42"}) as pre:
        os.kill(os.getpid(), signal.SIGINT)
        assert pre.requested and pre.signal_name == "SIGINT"
        assert "Ctrl-C" in pre.requeue_blocker()  # the user stopped it: never requeued
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
