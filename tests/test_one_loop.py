"""One training loop for every strategy, proven under real mpirun: the pipeline and the
parameter server get the NaN stop, the step reports, preemption checkpoints and (the
pipeline) the `mpi` gradient engine from the shared loop; a stopped pipeline peer is
named; MoE combines with data parallelism on the grid; the layering is checked, and so is
the structure: one method of TrainingLoop loops over epochs and batches, no other code."""

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import HPCTRAIN, ROOT, DrainedPopen, mpirun

SCRIPTS = ROOT / "tests" / "scripts"
SMALL = ["metrics.tensorboard=false", "data.prefetch=0", "train.log_every=1"]
PIPE2 = ["strategy=pipeline", "pipeline.stages=2", "pipeline.microbatches=2"]
PS3 = ["strategy=parameter_server", "ps.servers=1", "ps.mode=sync"]


def _args(run, overrides, resume=None):
    args = [HPCTRAIN, "train", "--run-dir", str(run)]
    if resume:
        args += ["--resume", resume]
    for o in [*SMALL, *overrides]:
        args += ["--set", o]
    return args


def _steps(run):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    return [x for x in lines if x["event"] == "step"]


def _nan_file(path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    x[254:] = np.nan  # two bad rows, reached after a few shuffled steps
    y = rng.integers(0, 3, 256)
    with h5py.File(path, "w") as f:
        for split in ("train", "val"):
            f[f"{split}/x"], f[f"{split}/y"] = x, y
    return ["data.source=hdf5", f"data.path={path}", "train.batch_size=8", "model.name=mlp"]


@pytest.mark.parametrize(
    "np_,strategy",
    [(2, PIPE2), (3, [*PS3, "train.batch_size=8"])],
    ids=["pipeline", "parameter_server"],
)
def test_nan_stops_every_training_rank_at_the_same_step(tmp_path, np_, strategy):
    data = _nan_file(tmp_path / "nan.h5")
    job = mpirun(np_, *_args(tmp_path / "run", [*data, *strategy]), timeout=180)
    assert job.returncode != 0, job.output
    step = int(re.search(r"loss became NaN/inf at step (\d+)", job.output).group(1))
    assert step > 1 and "check the data for NaN/inf values" in job.output
    # the loop's step reports: every step before the bad one was logged, none after
    assert [s["step"] for s in _steps(tmp_path / "run")] == list(range(1, step))


def _wait_for_steps(run, n, proc, limit=120):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and sum('"event": "step"' in x for x in metrics.open()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[0])
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {limit} s")


def _rank_pids(parent: int) -> dict[int, int]:
    """World rank -> pid of the processes mpirun started (read from their environment)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hpctrain" not in cmd or b"mpirun" in cmd:
            continue
        for item in env:
            if item.startswith(b"HPCTRAIN_TEST_JOB=") and item.endswith(str(parent).encode()):
                for e in env:
                    if e.startswith(b"OMPI_COMM_WORLD_RANK="):
                        out[int(e.split(b"=")[1])] = int(pid)
    return out


def _start(np_, args, tag, env=None, mpi_args=()):
    """mpirun of `args` whose ranks carry `tag` (found by _rank_pids); `env` updates the
    launch's environment, `mpi_args` go to mpirun."""
    env = dict(
        os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env or {})
    )
    env["HPCTRAIN_TEST_JOB"] = tag
    cmd = ["mpirun", "-np", str(np_), "-x", "HPCTRAIN_TEST_JOB", *mpi_args]
    if np_ > 2:
        cmd.append("--oversubscribe")
    return DrainedPopen(cmd + list(args), env=env, cwd=ROOT)


def _usr1_after_steps(proc, run, tag, steps=3, then=0.0) -> str:
    """SIGUSR1 to rank 0 once `steps` steps are in (and `then` seconds more); the job's
    output once it ends."""
    try:
        _wait_for_steps(run, steps, proc)
        time.sleep(then)
        os.kill(_rank_pids(tag)[0], signal.SIGUSR1)
        return proc.finish(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "layout",
    [
        # 256 steps an epoch: at 30 steps/s a 32-step epoch (4,096 samples) ended before
        # the stop landed once (6 Dec), and rank 1 stopped inside the epoch's checkpoint
        # is the checkpoint's longer wait to end, not the pipeline's (this test's)
        [*PIPE2, "data.train_samples=32768"],
        # ZeRO-3 over Gloo: its waits are under the MPI watchdog, which names the rank
        # before Gloo's own, later deadline fails the collective without a name
        ["train.zero=3", "train.allreduce=gloo", "train.zero_unit_mb=0.01"],
    ],
    ids=["pipeline", "gloo-zero3"],
)
def test_a_stopped_peer_is_named_within_the_timeout(tmp_path, layout):
    from hpctrain.backends.torch_pg import GROUPS_AFTER_WATCHDOG_S

    run = tmp_path / "run"
    # The deadline under test, for the whole run: in a healthy run of this job the
    # start-up's longest wait was 1-2 s (load average 5); the job ended 9.1 s after
    # SIGSTOP (the pipeline) and 14 s (ZeRO-3 over Gloo: the deadline, a poll and the
    # probe's 5 s) against the 18 and 23 s allowed below.
    timeout = 8
    args = _args(run, [*layout, "train.epochs=50", f"runtime.collective_timeout={timeout}"])
    tag = f"{os.getpid()}-stop-{layout[-1]}"
    proc = _start(2, args, tag=tag)
    try:
        _wait_for_steps(run, 3, proc)
        pids = _rank_pids(tag)
        assert set(pids) == {0, 1}, pids
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        out = proc.finish(timeout + 40)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"stopped peer: job ended {took:.1f} s after SIGSTOP (timeout {timeout} s)")
    assert proc.returncode != 0, out
    gloo = "train.allreduce=gloo" in layout
    assert took < timeout + (GROUPS_AFTER_WATCHDOG_S if gloo else 10), (took, out)
    # stage 0 waits for stage 1's gradient or to finish sending it an activation (or,
    # less often, for its step report, or in an epoch end's checkpoint, which rank 1 had
    # entered before it was stopped); ZeRO-3's rank 0 in a gather or reduce-scatter
    named = (
        "no answer from stage 1 (rank 1)" in out
        or "rank(s) 1 never arrived" in out
        or "rank(s) 1 did not answer the liveness probe" in out
    )
    assert named, out


# asynchronous parameter-server workers stop at steps of their own (worker 1 is slowed):
# the checkpoint keeps each one's step and sample position, and each resumes from its own
PS_ASYNC = ["strategy=parameter_server", "ps.servers=1", "ps.mode=async"]
SLOW_WORKER_1 = {"HPCTRAIN_FAULT_STEP_SLEEP": "1:0.02"}


@pytest.mark.parametrize(
    "np_,strategy,marker",
    [(2, PIPE2, "received: stopped at step"), (3, PS_ASYNC, "preempted: stopped at step")],
    ids=["pipeline", "parameter_server-async"],
)
def test_preemption_checkpoints_through_the_shared_loop_and_resumes(
    tmp_path, np_, strategy, marker
):
    from hpctrain.checkpoint import load

    run = tmp_path / "run"
    common = [*strategy, "train.epochs=40", "data.train_samples=2048", "train.batch_size=16"]
    tag = f"{os.getpid()}-pre-{np_}"
    proc = _start(np_, _args(run, common), tag=tag, env=SLOW_WORKER_1)
    out = _usr1_after_steps(proc, run, tag)
    assert proc.returncode == 0, out
    assert marker in out, out
    ckpts = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    assert ckpts, out
    step = int(ckpts[-1].stem.split("-")[1])
    saved = load(ckpts[-1]).trainer
    own = saved.get("ps_worker_step_0", step)  # worker 0 (rank 0, which logs) resumes there
    job = mpirun(
        np_, *_args(run, [*common, "train.max_steps=" + str(step + 2)], "auto"), timeout=180
    )
    assert job.returncode == 0, job.output
    assert f"at step {own}" in job.output and "resumed from" in job.output, job.output
    if strategy is PS_ASYNC:  # each worker went on from its own samples
        last = load(sorted((run / "checkpoints").glob("ckpt-*.h5"))[-1]).trainer
        per_epoch = 2048 // (16 * 2) * (16 * 2)  # samples in an epoch of 2 workers' batches

        def sample(t, i):
            return t[f"ps_worker_epoch_{i}"] * per_epoch + t[f"ps_worker_position_{i}"]

        steps = [saved[f"ps_worker_step_{i}"] for i in (0, 1)]
        assert steps[0] > steps[1], steps  # worker 1 was slowed: its own, earlier step
        for i in (0, 1):
            ran = last[f"ps_worker_step_{i}"] - saved[f"ps_worker_step_{i}"]
            assert sample(last, i) - sample(saved, i) == ran * 32, (i, saved, last)


def _signal_during_evaluation(run, epochs: int, tag: str, layout=()):
    """A 2-rank run of `epochs` epochs of 4 steps whose rank 0 takes 1 s a validation
    batch (8 batches of 256 per rank; a pipeline of 2 micro-batches of 32: 1 s a chunk of
    16 batches of 32, 8 chunks), SIGUSR1 on rank 0 after the 4th step, i.e. during the first epoch's
    evaluation: (its output, its exit code, its metrics.jsonl events, the trainer state
    of its newest checkpoint, the overrides to resume it with)."""
    from hpctrain.checkpoint import load

    common = [f"train.epochs={epochs}", "data.train_samples=256"]
    common += ["train.batch_size=32", "data.val_samples=4096", *layout]
    proc = _start(2, _args(run, common), tag=tag, env={"HPCTRAIN_FAULT_EVAL_SLEEP": "0:1"})
    # the epoch's 4th and last step, and 1 s into the evaluation's 8: the parameter
    # server's worker writes its last step's record before the ranks agree on a stop
    # (a signal there is a preemption: 1 run in 8-16 here sent it that soon)
    out = _usr1_after_steps(proc, run, tag, steps=4, then=1.0)
    events = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    saved = load(sorted((run / "checkpoints").glob("ckpt-*.h5"))[-1]).trainer
    return out, proc.returncode, events, saved, common


def test_a_signal_during_a_long_evaluation_ends_it_and_checkpoints_the_next_epoch(tmp_path):
    """SIGUSR1 on rank 0 while the epoch's evaluation runs: every rank agrees on it at
    the next batch, the evaluation stops there (no validation figures for the epoch)
    and the preemption checkpoint starts the next epoch, instead of the whole evaluation
    first (which a SLURM grace of 30 s may not leave time for); the resume trains that
    next epoch and evaluates it."""
    run = tmp_path / "run"
    out, code, events, saved, common = _signal_during_evaluation(
        run, 2, f"{os.getpid()}-eval-signal"
    )
    assert code == 0, out
    assert "received: stopped at step 4" in out, out
    epochs = [x for x in events if x["event"] == "epoch"]
    assert len(epochs) == 1 and epochs[0]["val_loss"] is None, epochs  # stopped early
    assert (saved["step"], saved["epoch"], saved["position"]) == (4, 1, 0), saved
    job = mpirun(2, *_args(run, common, "auto"), timeout=180)
    assert job.returncode == 0, job.output
    epochs = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    epochs = [x for x in epochs if x["event"] == "epoch"]
    assert epochs[-1]["epoch"] == 1 and epochs[-1]["step"] == 8, epochs
    assert epochs[-1]["val_loss"] is not None, epochs


@pytest.mark.parametrize(
    "layout",
    # data parallel's per-batch agreement is the test above's; what this one adds (the
    # last evaluation ends the run as finished) is the loop's, whatever the strategy:
    # make test runs it through the pipeline, whose agreement is its own
    [
        pytest.param((), marks=pytest.mark.extended),
        PIPE2,
        ["strategy=parameter_server", "train.batch_size=64"],  # one worker: 4 steps too
    ],
    ids=["data_parallel", "pipeline", "parameter_server"],
)
def test_a_signal_during_the_last_evaluation_ends_the_run_with_its_final_save(tmp_path, layout):
    """The same signal during the last epoch's evaluation: nothing is left to train, so the
    run ends as finished (exit 0, its final save at the last step, not preempted: a
    requeue would only start a finished job again), without the evaluation's figures.
    A pipeline's evaluation went on to its end (its stages run staggered): it now stops
    between chunks of batches; so did the parameter server's (its servers, with no
    batches, asked nothing)."""
    out, code, events, saved, _ = _signal_during_evaluation(
        tmp_path / "run", 1, f"{os.getpid()}-last-eval-signal", layout
    )
    assert code == 0, out
    assert "received: stopped at step" not in out, out
    epochs = [x for x in events if x["event"] == "epoch"]
    assert len(epochs) == 1 and epochs[0]["val_loss"] is None, epochs  # stopped early
    summary = next(x for x in events if x["event"] == "summary")
    assert summary["steps"] == 4 and summary["preempted"] is None, summary
    # (the parameter server's final state keeps its last epoch and position)
    end = (4, 0, 256) if "strategy=parameter_server" in layout else (4, 1, 0)
    assert (saved["step"], saved["epoch"], saved["position"]) == end, saved


def test_moe_inside_pipeline_stages_with_zero_is_refused_before_any_work(tmp_path):
    """Experts in pipeline stages train (tests/test_tensor_parallel_jobs.py); with ZeRO
    (which would shard them with the dense state) every rank stops first."""
    overrides = [
        *PIPE2,
        "model.name=transformer",
        "data.task=tokens",
        "model.moe={experts: 2, top_k: 1}",
        "train.zero=1",
    ]
    job = mpirun(2, *_args(tmp_path / "run", overrides), timeout=120)
    assert job.returncode == 2, job.output
    assert "rank(s) 0-1: invalid configuration" in job.output, job.output
    assert job.output.count("model.moe: mixture-of-experts blocks inside") == 1, job.output


def test_an_mpi_without_thread_multiple_is_refused_clearly():
    job = mpirun(2, HPCTRAIN, "doctor", env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, timeout=120)
    assert job.returncode != 0, job.output
    assert "needs MPI_THREAD_MULTIPLE" in job.output, job.output


# --- layering -------------------------------------------------------------------------------
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def test_the_import_contracts_hold():
    proc = subprocess.run([LINT_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    contracts = (ROOT / ".importlinter").read_text().count("[importlinter:contract:")
    assert contracts >= 6  # layers, frameworks, ..., product code imports no test code
    assert f"Contracts: {contracts} kept, 0 broken" in proc.stdout, proc.stdout


def test_the_contracts_catch_a_backend_importing_a_strategy(tmp_path):
    copy = tmp_path / "hpctrain"
    shutil.copytree(ROOT / "hpctrain", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    with (copy / "backends" / "base.py").open("a") as f:
        f.write("\nfrom ..strategies import base as _upward  # noqa\n")
    proc = subprocess.run(
        [LINT_IMPORTS],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout
    assert "hpctrain.backends.base -> hpctrain.strategies.base" in proc.stdout, proc.stdout


# A training loop: a `for`/`while` that itself (not through a nested loop) takes steps,
# calling `<x>.step(batch, lr)` or `<x>.train_step(...)` with arguments (an optimizer's
# argument-free `.step()` is not one), or that iterates over a strategy's or a shard's
# training batches (`<x>.batches(epoch, position)`, `<x>.iterate(epoch, position)`).
STEP_CALLS = {"step", "train_step"}
BATCH_ITERATORS = {"batches", "iterate"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(loop: ast.AST):
    """The nodes of a loop's body and else, without those of nested loops (their headers
    are kept: they run in this loop's body), functions or classes."""
    todo = [*loop.body, *loop.orelse]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.For, ast.AsyncFor)):
            todo.append(node.iter)
        elif isinstance(node, ast.While):
            todo.append(node.test)
        elif not isinstance(node, SCOPES):
            yield node
            todo.extend(ast.iter_child_nodes(node))


def _method_call(node: ast.AST, names: set[str]) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
        and bool(node.args or node.keywords)
    )


def _is_training_loop(loop: ast.AST) -> bool:
    if isinstance(loop, (ast.For, ast.AsyncFor)) and _method_call(loop.iter, BATCH_ITERATORS):
        return True
    return any(_method_call(n, STEP_CALLS) for n in _own_nodes(loop))


def _training_loops(sources: dict[str, str]) -> list[tuple]:
    """(file, class, function, the loop, the loops around it in that function) of every
    training loop in `sources` (path -> source text)."""
    found = []

    def visit(node, path, cls, fn, outer):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, path, child.name, fn, [])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, path, cls, child.name, [])
            elif isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                if _is_training_loop(child):
                    found.append((path, cls, fn, child, outer))
                visit(child, path, cls, fn, [*outer, child])
            else:
                visit(child, path, cls, fn, outer)

    for path, text in sorted(sources.items()):
        visit(ast.parse(text, path), path, "", "", [])
    return found


def _package_sources(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): p.read_text() for p in (root / "hpctrain").rglob("*.py")
    }


def test_there_is_one_training_loop():
    fits = [p for p in (ROOT / "hpctrain").rglob("*.py") if "def fit(" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in fits] == ["hpctrain/loop.py"]
    # The structure: one method of TrainingLoop steps through the strategy's batches, one
    # epoch after another; no strategy, backend or other module loops over steps itself.
    loops = _training_loops(_package_sources(ROOT))
    where = [(path, cls, fn, loop.lineno) for path, cls, fn, loop, _ in loops]
    assert [w[:2] for w in where] == [("hpctrain/loop.py", "TrainingLoop")], where
    _, _, _, loop, outer = loops[0]
    assert isinstance(loop, ast.For) and loop.iter.func.attr == "batches", ast.unparse(loop)
    # one call per batch, to the strategy's step (never the backend's train_step directly)
    calls = [n.func.attr for n in _own_nodes(loop) if _method_call(n, STEP_CALLS)]
    assert calls == ["step"], ast.unparse(loop)
    headers = [ast.unparse(o.test if isinstance(o, ast.While) else o.iter) for o in outer]
    assert len(outer) == 1 and "epoch" in headers[0], headers  # inside the loop over epochs


@pytest.mark.parametrize(
    "added",
    [
        # a strategy that runs its own epochs over its shard, driving the backend
        "    def fit(self):\n"
        "        for epoch in range(self.epochs):\n"
        "            for batch in self.data.iterate(epoch, 0):\n"
        "                self.backend.train_step(batch, 0.1)\n",
        # a strategy that steps itself in a while loop
        "    def run_all(self, batches, lr):\n"
        "        it = iter(batches)\n"
        "        while True:\n"
        "            self.step(next(it), lr)\n",
    ],
    ids=["epochs-over-train_step", "while-over-step"],
)
def test_the_one_loop_check_finds_a_second_loop(added):
    sources = _package_sources(ROOT)
    path = "hpctrain/strategies/data_parallel.py"
    sources[path] += "\n\nclass SecondLoop:\n" + added
    where = [(p, cls) for p, cls, *_ in _training_loops(sources)]
    assert where == [("hpctrain/loop.py", "TrainingLoop"), (path, "SecondLoop")], where


def test_a_preempted_slurm_job_is_requeued_after_its_summary_is_written(tmp_path):
    # `scontrol requeue` makes SLURM end the running job at once: CI lost a preempted run's
    # summary to that race. The requeue must be the run's last act, so a stand-in scontrol
    # (the real one against a running job is in test_slurm.py) copies the metrics as they
    # are when it is called.
    run, bin_ = tmp_path / "run", tmp_path / "bin"
    bin_.mkdir()
    seen, called = tmp_path / "metrics-at-requeue.jsonl", tmp_path / "scontrol-args"
    scontrol = bin_ / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {called}\ncp {run / "metrics.jsonl"} {seen}\n')
    scontrol.chmod(0o755)
    common = ["train.epochs=40", "data.train_samples=2048", "train.batch_size=16"]
    tag = f"{os.getpid()}-requeue"
    # SLURM_JOB_ID for the ranks only: mpirun itself would look for a SLURM allocation.
    ranks_env = ["-x", "PATH", "-x", "SLURM_JOB_ID=4242"]
    path = {"PATH": f"{bin_}:{os.environ['PATH']}"}
    proc = _start(2, _args(run, common), tag=tag, env=path, mpi_args=ranks_env)
    out = _usr1_after_steps(proc, run, tag)
    assert proc.returncode == 0, out
    assert "SIGUSR1 received: stopped at step" in out and "requeueing the job" in out, out
    assert called.read_text().split() == ["requeue", "4242"], out
    summaries = [json.loads(x) for x in seen.open() if '"event": "summary"' in x]
    assert len(summaries) == 1 and summaries[0]["preempted"] == "SIGUSR1", out
