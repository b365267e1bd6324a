"""`hpctrain elastic`: the supervisor's parts (hostfile, world sizes, batch plan, host
probes) and, under real mpirun on this node, a rank killed mid-run: restarted from the
newest checkpoint it ends bit for bit where an uninterrupted run ends, and a budget of 0
ends with a clear message. Losing a whole node is in tests/test_multinode.py."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import time

import numpy as np
import pytest
from cluster import finish, launch, start
from mpirun import HPCTRAIN, mpirun

from hpctrain.checkpoint import find_latest_valid, load
from hpctrain.config import Config
from hpctrain.elastic.batch import plan_batch, ranks_per_replica, replicas_of
from hpctrain.elastic.cli import _np_range, _without_reuse_flags
from hpctrain.elastic.hosts import Host, agent_problem, probe, read_hostfile, tcp_problem
from hpctrain.errors import ConfigError


# --- parts -------------------------------------------------------------------------------
def test_hostfile_reads_open_mpi_lines_and_refuses_nonsense(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the allocation\nnode1 slots=4\nnode2 slots=2 max_slots=8\n\nnode3\n")
    assert read_hostfile(f) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    f.write_text("node1 slots=0\n")
    with pytest.raises(ConfigError, match="slots must be a positive integer"):
        read_hostfile(f)
    f.write_text("node1\nnode1\n")
    with pytest.raises(ConfigError, match="listed twice"):
        read_hostfile(f)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_hostfile(tmp_path / "missing")


def test_allocation_hosts_come_from_slurm_variables(monkeypatch):
    from hpctrain.elastic import hosts as hosts_module

    assert hosts_module.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        hosts_module.allocation_hosts({})

    class Done:
        returncode, stdout, stderr = 0, "n01\nn02\n", ""

    monkeypatch.setattr(hosts_module.subprocess, "run", lambda *a, **k: Done())
    env = {"SLURM_JOB_NODELIST": "n[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert hosts_module.allocation_hosts(env) == [Host("n01", 4), Host("n02", 4)]
    with pytest.raises(ConfigError, match="does not match the 2 nodes"):
        hosts_module.allocation_hosts({**env, "SLURM_TASKS_PER_NODE": "4"})


def test_np_range_and_reuse_flags():
    assert _np_range(None) == (1, None)
    assert _np_range("2:8") == (2, 8)
    assert _np_range("2:") == (2, None)
    with pytest.raises(ConfigError, match="MIN <= MAX"):
        _np_range("4:2")
    words = ["train", "--run-dir", "r", "--resume", "auto", "--new", "--set", "a=1"]
    assert _without_reuse_flags(words) == ["train", "--run-dir", "r", "--set", "a=1"]


@pytest.mark.parametrize(
    "options,train,message",
    [
        (["--probe-timeout", "0"], [], "--probe-timeout 0: give seconds above 0"),
        (["--probe-port", "70000"], [], "--probe-port 70000: not a TCP port"),
        (["--launcher", "srun"], [], "srun not found on PATH"),
        ([], ["--overw"], "write --overwrite in full, not --overw"),
        ([], ["--run-dir", "/etc/passwd/x"], "/etc/passwd is not a directory"),
    ],
)
def test_what_would_fail_at_the_first_launch_or_restart_is_refused_at_once(
    tmp_path, capsys, monkeypatch, options, train, message
):
    from hpctrain.cli import main as cli_main

    monkeypatch.setenv("PATH", str(tmp_path))  # an mpirun here, no srun
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"localhost slots=2\n")
    run = ["--run-dir", str(tmp_path / "run")] if "--run-dir" not in train else []
    argv = ["elastic", "--hostfile", str(hosts), *options, "--", "train", *run, *train]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
    hosts.write_bytes(b"\xff\xfe\n")
    argv = ["elastic", "--hostfile", str(hosts), "--", "train", "--run-dir", str(tmp_path)]
    assert cli_main(argv) == 2
    assert "not a text file" in capsys.readouterr().err


def test_a_lost_replica_keeps_the_global_batch_and_the_scaled_lr():
    cfg = Config.load(None, ["train.batch_size=8", "optimizer.lr=0.1"])  # linear scaling
    plan = plan_batch(cfg, first_replicas=4, replicas=2)
    assert (plan.grad_accum, plan.global_batch) == (2, 32)
    assert plan.lr * 2 == pytest.approx(0.1 * 4)  # the scaled lr of the first launch
    odd = plan_batch(cfg, first_replicas=4, replicas=3)  # 32 is not a multiple of 8 x 3
    assert (odd.grad_accum, odd.global_batch, odd.lr) == (1, 24, 0.1)
    assert "not a multiple" in odd.note and "lr 0.3 instead of 0.4" in odd.note
    pipe = Config.load(
        None,
        ["strategy=pipeline", "pipeline.microbatches=2", "train.batch_size=8", "optimizer.lr=0.1"],
    )  # a step is 2 micro-batches of 8 per replica: the micro-batches take up the loss
    plan = plan_batch(pipe, first_replicas=2, replicas=1)
    assert (plan.grad_accum, plan.microbatches, plan.global_batch) == (1, 4, 32)
    assert plan.lr == pytest.approx(0.2) and "pipeline.microbatches 2 -> 4" in plan.note
    tp = Config.load(None, ["parallel.tensor=2", "model.name=transformer", "data.task=tokens"])
    assert replicas_of(tp, 8) == 4


def test_a_pipeline_with_tensor_groups_keeps_the_global_batch_when_a_node_is_lost():
    """pipe 2 x tensor 2: a replica is 4 ranks (the tensor axis was ignored before, so
    8 ranks counted 4 replicas instead of 2, and the restart plan doubled the batch)."""
    cfg = Config.load(
        None,
        [
            "strategy=pipeline",
            "pipeline.stages=2",
            "pipeline.microbatches=2",
            "parallel.tensor=2",
            "model.name=transformer",
            "data.task=tokens",
            "train.batch_size=8",
            "optimizer.lr=0.1",
        ],
    )
    assert ranks_per_replica(cfg) == 4
    assert (replicas_of(cfg, 8), replicas_of(cfg, 4)) == (2, 1)
    plan = plan_batch(cfg, replicas_of(cfg, 8), replicas_of(cfg, 4))  # a node of 4 lost
    assert (plan.microbatches, plan.global_batch) == (4, 32)  # 2 x 2 x 8 kept
    assert plan.lr == pytest.approx(0.2)  # linear scaling: the scaled lr stays 0.2


def test_probes_tell_a_live_host_from_a_lost_one():
    with socket.socket() as s:  # a port nobody listens on: the kernel refuses, so alive
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert tcp_problem("127.0.0.1", closed, 2.0) is None
    assert "does not resolve" in tcp_problem("no-such-host.invalid", 22, 2.0)
    ok = [sys.executable, "-c", "import sys; sys.exit(0)"]
    bad = [sys.executable, "-c", "import sys; print('no route to host'); sys.exit(255)"]
    assert agent_problem(ok, "localhost", 5.0) is None
    assert "no route to host" in agent_problem(bad, "localhost", 5.0)
    found = probe([Host("127.0.0.1", 1), Host("no-such-host.invalid", 1)], closed, 2.0, bad)
    assert found["127.0.0.1"] is None  # the launch node: alive without asking
    assert "does not resolve" in found["no-such-host.invalid"]


# --- jobs on this node ---------------------------------------------------------------------
SMALL = [
    "backend=torch",
    "model.hidden=[32]",
    "data.train_samples=1024",
    "data.val_samples=128",
    "train.batch_size=16",
    "train.epochs=1",
    "train.log_every=1",
    "train.allreduce=mpi",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=10",
    "metrics.tensorboard=false",
    "metrics.progress_bar=false",
]


def _sets(*extra: str) -> list[str]:
    return [w for o in [*SMALL, *extra] for w in ("--set", o)]


def _elastic(tmp_path, run, *extra, env=None, restarts=2):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    argv = [HPCTRAIN, "elastic", "--hostfile", str(hosts), "--max-restarts", str(restarts)]
    argv += ["--probe-timeout", "2", "--", "train", "--run-dir", str(run), *_sets(*extra)]
    return launch(argv, timeout=300, env=env)  # its process group is killed on timeout


def _events(run):
    return [json.loads(x) for x in (run / "elastic" / "events.jsonl").open()]


def _weights(run):
    return load(find_latest_valid(run / "checkpoints").path).model_weights()


KILL_RANK_1_AT_STEP_8 = {"HPCTRAIN_FAULT_DIE_AT_STEP": "1:8"}


STRATEGIES = {  # strategy: (settings, the rank killed at step 8)
    "data_parallel": ([], 1),
    "pipeline": (["strategy=pipeline", "model.hidden=[32,32]", "pipeline.microbatches=2"], 1),
    # rank 0 is the one worker (rank 1 serves): a dead worker process ends the job under
    # Open MPI, and the supervisor's restart is the parameter server's answer to it
    "parameter_server": (["strategy=parameter_server", "ps.mode=sync"], 0),
}


# The pipeline's and the parameter server's cases (12 and 11 s) are in `make
# test-extended`: the supervisor's restart is the same for every strategy (data parallel
# here), and each one's resume from its checkpoint bit for bit is test_pipeline.py's and
# test_ps.py's (and the supervisor's batch plan for a pipeline losing a node is above).
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(s, marks=[pytest.mark.extended] if s != "data_parallel" else [])
        for s in STRATEGIES
    ],
)
def test_a_killed_rank_is_restarted_from_the_checkpoint_and_ends_bit_for_bit(tmp_path, strategy):
    sets, victim = STRATEGIES[strategy]
    # the uninterrupted run: the same command on warm ranks (the supervisor's first
    # launch is exactly this one; its uninterrupted path is the budget test's and the
    # multi-node tests')
    plain = mpirun(2, HPCTRAIN, "train", "--run-dir", str(tmp_path / "plain"), *_sets(*sets))
    assert plain.returncode == 0, plain.output
    kill = {"HPCTRAIN_FAULT_DIE_AT_STEP": f"{victim}:8"}
    job = _elastic(tmp_path, tmp_path / "run", *sets, env=kill)
    assert job.returncode == 0, job.output
    kinds = [e["event"] for e in _events(tmp_path / "run")]
    assert kinds == ["start", "launch", "failure", "probe", "launch", "end"], kinds
    assert "restart 1 of 2: 2 ranks on localhost" in job.output, job.output
    assert "resumed from" in job.output and "at step 6" in job.output, job.output
    a, b = _weights(tmp_path / "run"), _weights(tmp_path / "plain")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_restart_budget_of_zero_ends_with_a_clear_message(tmp_path):
    job = _elastic(tmp_path, tmp_path / "run", env=KILL_RANK_1_AT_STEP_8, restarts=0)
    assert job.returncode != 0, job.output
    assert "the restart budget of 0 is used up" in job.output, job.output
    assert (
        "its newest checkpoint (step " in job.output and "resume with --resume auto" in job.output
    )
    kinds = [e["event"] for e in _events(tmp_path / "run")]
    assert kinds == ["start", "launch", "failure", "gave_up"], kinds


def test_a_sigterm_to_the_supervisor_ends_the_job_with_its_checkpoint(tmp_path):
    """A SIGTERM to the supervisor: the ranks get a stop signal and take their
    checkpoint, here one whose write takes 1.5 s (mpirun itself would end the ranks 1 s
    after a SIGTERM of its own, and the checkpoint was lost); no restart follows."""
    hosts, run = tmp_path / "hosts", tmp_path / "run"
    hosts.write_text("localhost slots=2\n")
    argv = [HPCTRAIN, "elastic", "--hostfile", str(hosts), "--probe-timeout", "2", "--"]
    argv += [
        "train",
        "--run-dir",
        str(run),
        *_sets("data.train_samples=4096", "checkpoint.every_steps=1000"),
    ]
    slow = {"HPCTRAIN_FAULT_STEP_SLEEP": "0:0.1", "HPCTRAIN_FAULT_WRITE_DELAY": "0:1.5"}
    proc = start(argv, slow)
    deadline = time.monotonic() + 120
    while '"step": 5,' not in _text(run / "metrics.jsonl") and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    job = finish(proc, 120)
    assert job.returncode == 128 + signal.SIGTERM, job.output
    # outside SLURM a SIGTERM is a stop request: the ranks get SIGUSR2 (never requeued)
    stopped = re.search(r"SIGUSR2 received: stopped at step (\d+), checkpoint", job.output)
    assert stopped and "stopped by SIGTERM (the job exited 0)" in job.output, job.output
    assert "requeueing" not in job.output, job.output  # nothing to requeue: not said
    assert find_latest_valid(run / "checkpoints").step == int(stopped.group(1))
    kinds = [e["event"] for e in _events(run)]
    assert kinds == ["start", "launch", "stopped"], kinds


def _text(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_elastic_refuses_a_job_it_could_not_restart(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    for extra, message in (
        ([], "needs --run-dir"),
        (
            ["--run-dir", str(tmp_path / "r"), "--set", "checkpoint.enabled=false"],
            "enabled is false",
        ),
    ):
        done = launch([HPCTRAIN, "elastic", "--hostfile", str(hosts), "--", "train", *extra], 60)
        assert done.returncode == 2, done.output
        assert message in done.output and "Traceback" not in done.output


@pytest.mark.parametrize(
    "slurm, first, forwarded",
    [
        (True, "SIGTERM", "SIGUSR1"),  # a scheduler's preemption: checkpoint and requeue
        (False, "SIGTERM", "SIGUSR2"),  # a stop request outside SLURM: nothing to requeue
        (True, "SIGINT", "SIGUSR2"),  # Ctrl-C: the user's stop, never requeued
        (True, "SIGUSR1", "SIGUSR1"),  # the time limit's warning
        (True, "SIGUSR2", "SIGUSR2"),  # a stop without requeue, even under SLURM
    ],
)
def test_a_stop_reaches_the_job_as_a_signal_the_launcher_waits_for(
    tmp_path, monkeypatch, slurm, first, forwarded
):
    """SIGTERM/SIGINT to the supervisor become SIGUSR1 or SIGUSR2 for the launcher (mpirun
    kills its ranks 1 s after its own SIGTERM/SIGINT, before they could checkpoint); a
    second one goes through as it is; a stop between attempts starts no new one."""
    import signal as sig

    from hpctrain.elastic import supervisor

    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "7")
    else:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first, forwarded = sig.Signals[first], sig.Signals[forwarded]
    sent = []

    class Launcher:
        def __init__(self, argv, **kwargs):
            assert kwargs["start_new_session"]  # a terminal's Ctrl-C reaches only us
            self.argv = argv

        def poll(self):
            return None

        def send_signal(self, s):
            sent.append(s)

        def wait(self, timeout=None):
            sup._forward(first, None)
            sup._forward(sig.SIGINT, None)
            return 0

    monkeypatch.setattr(supervisor.subprocess, "Popen", Launcher)
    opts = supervisor.Options(["train"], [], tmp_path, [])
    sup = supervisor.Supervisor(opts, None)
    assert sup.launch(["mpirun"]) == 0
    assert sent == [forwarded, sig.SIGINT] and sup.stop_signal == first
    assert sup.launch(["mpirun"]) is None  # stopped: not started again
    assert sent == [forwarded, sig.SIGINT]


def _watched_attempt(tmp_path, monkeypatch, answers: list[bool], argv: list[str]):
    """An attempt (a real process, `argv`) under the watch of hpcn2, whose probes answer
    as `answers` says in turn (the last one from then on); (exit code, seconds, events).
    The network side (a link taken down under srun): test_multinode.py."""
    from hpctrain.elastic import supervisor

    left = list(answers)

    def probe(hosts, *args):
        alive = left.pop(0) if len(left) > 1 else left[0]
        return {h.name: None if alive else "no answer on TCP port 22 within 1 s" for h in hosts}

    monkeypatch.setattr(supervisor, "probe", probe)
    opts = supervisor.Options(["train"], [], tmp_path, [Host("hpcn2", 1)], watch_interval=0.1)
    start = time.monotonic()
    code = supervisor.Supervisor(opts, None).launch(argv)
    events = tmp_path / "elastic" / "events.jsonl"
    events = [json.loads(x) for x in events.open()] if events.exists() else []
    return code, time.monotonic() - start, events


def test_a_host_silent_while_the_job_runs_ends_the_attempt(tmp_path, monkeypatch):
    """The watch: a host that answered as the attempt started and then misses two probes
    in a row ends it (an srun step would otherwise wait for SLURM's SlurmdTimeout); one
    missed probe alone does not."""
    answers = [True, True, False, True, True, False, False]  # at launch, then each probe
    code, took, events = _watched_attempt(tmp_path, monkeypatch, answers, ["sleep", "60"])
    assert code == -signal.SIGTERM and took < 20, (code, took)
    assert [e["event"] for e in events] == ["lost_while_running"], events
    assert list(events[0]["lost"]) == ["hpcn2"], events


def test_a_host_that_never_answered_is_left_out_of_the_watch(tmp_path, monkeypatch):
    """A probe port a firewall drops never answers: such a host is named once and not
    watched, instead of ending every attempt."""
    code, _, events = _watched_attempt(tmp_path, monkeypatch, [False], ["sleep", "1"])
    assert code == 0 and [e["event"] for e in events] == ["unwatched"], events


@pytest.mark.parametrize(
    "codes, launches, result",
    [([3, 0], 2, 0), ([2], 1, 2), ([1, 3, 0], 3, 0)],
    ids=["one-ranks-error-restarted", "agreed-error-not", "crash-then-one-ranks-error"],
)
def test_only_an_agreed_user_error_is_not_restarted(tmp_path, monkeypatch, codes, launches, result):
    """Exit 2 (every rank agreed on a user error) would fail the same way again; exit 3
    (a user error one rank saw alone, as an unreadable file on one node) may pass, and
    is restarted like a crash (failfast.py)."""
    from hpctrain.config import Config
    from hpctrain.elastic import supervisor
    from hpctrain.elastic.hosts import Host

    left = list(codes)
    monkeypatch.setattr(supervisor.Supervisor, "launch", lambda self, argv: left.pop(0))
    monkeypatch.setattr(supervisor, "probe", lambda hosts, *a: {h.name: None for h in hosts})
    opts = supervisor.Options(["train"], [], tmp_path, [Host("localhost", 2)], max_restarts=3)
    assert supervisor.Supervisor(opts, Config.load(None, [])).run() == result
    events = [json.loads(x)["event"] for x in (tmp_path / "elastic" / "events.jsonl").open()]
    assert events.count("launch") == launches and not left, events
