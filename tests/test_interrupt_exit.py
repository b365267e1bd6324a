"""An interrupt is not a preemption (issue 29, item 4).

Ctrl-C reaches a process started alone as SIGINT; mpirun passes it on to its ranks as
SIGTERM. Outside SLURM both are a stop the user asked for: checkpoint, say "interrupted",
no requeue warning, and exit 128 + the signal's number (130 for Ctrl-C). Under SLURM a
SIGTERM stays a preemption (requeued). mpirun's own exit status after Ctrl-C is Open
MPI's (1, whatever its ranks return), and the interrupt line says so.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from mpirun import HPCTRAIN, ROOT
from signalled_runs import sets, stop_after_steps

from hpctrain.runtime.preemption import Preemption, interrupt_exit_code, interrupt_reason

SLURM = {"SLURM_JOB_ID": "42"}
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "2"}


# --- before the CLI runs ----------------------------------------------------------------
def test_ctrl_c_while_the_cli_is_imported_is_one_line_not_a_traceback(monkeypatch, capsys):
    """The console script's guard (entry.py): a Ctrl-C in the imports before any handler
    of ours printed a traceback of import machinery on every rank."""
    import sys
    import types

    from hpctrain import entry

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "hpctrain.cli", Interrupted("hpctrain.cli"))
    assert entry.main() == 130
    assert capsys.readouterr().err == "hpctrain: interrupted (Ctrl-C) while starting\n"


def test_importing_the_package_imports_only_its_version():
    """What stands before the console script's guard: the package's own __init__."""
    import subprocess
    import sys

    code = "import sys, hpctrain; print(*sorted(m for m in sys.modules if m.startswith(('hpctrain', 'yaml'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["hpctrain", "hpctrain.version"], out.stdout
    check = "from hpctrain import Config, TrainingLoop, __version__; print(Config.__name__)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Config"


# --- which stops are interrupts ---------------------------------------------------------
@pytest.mark.parametrize(
    "name,env,code",
    [
        ("SIGINT", {}, 130),
        ("SIGINT", SLURM, 130),  # srun passes Ctrl-C on as SIGINT: the user's stop
        ("SIGTERM", {}, 143),  # kill, timeout(1): a stop request outside SLURM
        ("SIGTERM", MPIRUN, 143),  # mpirun's Ctrl-C
        ("SIGTERM", {**SLURM, **MPIRUN}, 0),  # scancel / preemption: requeued, as before
        ("SIGUSR1", {}, 0),
        ("SIGUSR1", SLURM, 0),
        (None, {}, 0),
        ("a signal", {}, 0),  # the parameter server's summary
    ],
)
def test_exit_code_after_a_clean_stop(name, env, code):
    assert interrupt_exit_code(name, env) == code
    assert (interrupt_reason(name, env) is not None) == (code != 0)


def test_sigusr2_is_a_stop_never_requeued_that_exits_zero():
    """`kill -USR2 <mpirun>` or `hpctrain elastic`'s Ctrl-C: mpirun forwards it and waits."""
    for env in ({}, SLURM, MPIRUN):
        assert interrupt_exit_code("SIGUSR2", env) == 0
        assert "without requeue" in interrupt_reason("SIGUSR2", env)
        with Preemption(env=env) as pre:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert pre.requested and "SIGUSR2" in pre.requeue_blocker()


def test_mpirun_sigterm_is_named_as_its_ctrl_c_and_its_exit_status_explained():
    why = interrupt_reason("SIGTERM", MPIRUN)
    assert "Ctrl-C" in why and "mpirun exits 1" in why
    assert "Ctrl-C" not in interrupt_reason("SIGTERM", {})


def test_sigterm_is_an_interrupt_outside_slurm_and_a_preemption_under_it():
    for env, interrupted in (({}, True), (SLURM, False)):
        with Preemption(env=env) as pre:
            os.kill(os.getpid(), signal.SIGTERM)
            assert pre.signal_name == "SIGTERM"
            blocker = pre.requeue_blocker()
        if interrupted:
            assert blocker.startswith("interrupted (") and "not running under SLURM" not in blocker
        else:
            assert blocker is None  # may be requeued: SLURM's behaviour is unchanged


# --- real runs ------------------------------------------------------------------------------
def _assert_checkpointed_stop(run: Path, out: str, name: str) -> None:
    assert f"{name} received: stopped at step" in out, out
    assert "Traceback" not in out and "MPI_ABORT" not in out, out
    assert "not requeueing" not in out, out  # no warning about a requeue nobody asked for
    assert "continue with --resume auto" in out, out
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    summary = [json.loads(x) for x in (run / "metrics.jsonl").open()][-1]
    assert summary["event"] == "summary" and summary["preempted"] == name, summary
    assert checkpoints and int(checkpoints[-1].stem.split("-")[1]) == summary["steps"], out


# SIGTERM while the run still starts (its directory made, its data and model not yet):
# recorded from the start, acted on at the first step, not the default action's death
@pytest.mark.parametrize("sig,code,steps", [(signal.SIGINT, 130, 5), (signal.SIGTERM, 143, 0)])
def test_a_process_alone_stops_as_an_interrupted_program(tmp_path, sig, code, steps):
    run = tmp_path / "run"
    cmd = [HPCTRAIN, "train", "--run-dir", str(run), *sets()]
    group = sig == signal.SIGINT
    rc, out = stop_after_steps(cmd, run, sig, group=group, cwd=ROOT, steps=steps)
    _assert_checkpointed_stop(run, out, sig.name)
    assert "interrupted (" in out, out
    assert rc == code, out


def test_ctrl_c_on_mpirun_is_an_interrupt_and_mpirun_exits_1(tmp_path):
    run = tmp_path / "run"
    cmd = ["mpirun", "-np", "2", HPCTRAIN, "train", "--run-dir", str(run), *sets()]
    rc, out = stop_after_steps(cmd, run, signal.SIGINT, group=True, cwd=ROOT)
    _assert_checkpointed_stop(run, out, "SIGTERM")  # mpirun passes Ctrl-C on as SIGTERM
    assert "interrupted (Ctrl-C or a kill of mpirun" in out, out
    # Open MPI's mpirun ends 1 after Ctrl-C whatever its ranks return (its abort status);
    # the line above says so, so a clean, checkpointed stop is not mistaken for a crash.
    assert "mpirun exits 1" in out and rc == 1, (rc, out)


def test_sigusr2_to_mpirun_stops_every_rank_with_a_checkpoint_and_exits_0(tmp_path):
    """The stop to send mpirun for a model whose checkpoint outlasts mpirun's 1 s between
    its own SIGTERM and SIGKILL: mpirun forwards SIGUSR2 and waits; never requeued."""
    run = tmp_path / "run"
    cmd = ["mpirun", "-np", "2", HPCTRAIN, "train", "--run-dir", str(run), *sets()]
    rc, out = stop_after_steps(cmd, run, signal.SIGUSR2, group=False, cwd=ROOT)
    _assert_checkpointed_stop(run, out, "SIGUSR2")
    assert "interrupted (SIGUSR2, a stop without requeue), not requeued" in out, out
    assert rc == 0, (rc, out)
