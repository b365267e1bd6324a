"""One training loop for every strategy, proven under real mpirun: the pipeline and the
parameter server get the NaN stop, the step reports, preemption checkpoints and (the
pipeline) the `mpi` gradient engine from the shared loop; a stopped pipeline peer is
named; MoE combines with data parallelism on the grid; the layering is checked."""

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
from mpirun import HPCTRAIN, ROOT, mpirun

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


def _start(np_, args, tag):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["HPCTRAIN_TEST_JOB"] = tag
    cmd = ["mpirun", "-np", str(np_), "-x", "HPCTRAIN_TEST_JOB"]
    if np_ > 2:
        cmd.append("--oversubscribe")
    return subprocess.Popen(
        cmd + list(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def _finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job did not end within {timeout} s:\n{out}") from None
    return out


def test_a_stopped_pipeline_peer_is_named_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    timeout = 8
    args = _args(
        run,
        [
            *PIPE2,
            "train.epochs=50",
            "data.train_samples=4096",
            f"runtime.collective_timeout={timeout}",
        ],
    )
    proc = _start(2, args, tag=str(os.getpid()) + "-stop")
    try:
        _wait_for_steps(run, 3, proc)
        pids = _rank_pids(str(os.getpid()) + "-stop")
        assert set(pids) == {0, 1}, pids
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        out = _finish(proc, timeout + 30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"stopped pipeline peer: job ended {took:.1f} s after SIGSTOP (timeout {timeout} s)")
    assert proc.returncode != 0, out
    assert took < timeout + 10, (took, out)
    # stage 0 waits for stage 1's gradient (or, less often, for its step report, or in
    # an epoch end's checkpoint, which rank 1 had entered before it was stopped)
    named = (
        "no answer from stage 1 (rank 1)" in out
        or "rank(s) 1 never arrived" in out
        or "rank(s) 1 did not answer the liveness probe" in out
    )
    assert named, out


@pytest.mark.parametrize(
    "np_,strategy,marker",
    [(2, PIPE2, "received: stopped at step"), (3, PS3, "preempted: stopped at step")],
    ids=["pipeline", "parameter_server"],
)
def test_preemption_checkpoints_through_the_shared_loop_and_resumes(
    tmp_path, np_, strategy, marker
):
    run = tmp_path / "run"
    common = [*strategy, "train.epochs=40", "data.train_samples=2048", "train.batch_size=16"]
    tag = f"{os.getpid()}-pre-{np_}"
    proc = _start(np_, _args(run, common), tag=tag)
    try:
        _wait_for_steps(run, 3, proc)
        os.kill(_rank_pids(tag)[0], signal.SIGUSR1)
        out = _finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert marker in out, out
    ckpts = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    assert ckpts, out
    step = int(ckpts[-1].stem.split("-")[1])
    job = mpirun(
        np_, *_args(run, [*common, "train.max_steps=" + str(step + 2)], "auto"), timeout=180
    )
    assert job.returncode == 0, job.output
    assert f"at step {step}" in job.output and "resumed from" in job.output, job.output


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
    assert job.output.count("rank(s) 0-1: model.moe: mixture-of-experts blocks inside") == 1, (
        job.output
    )


def test_an_mpi_without_thread_multiple_is_refused_clearly():
    job = mpirun(2, HPCTRAIN, "doctor", env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, timeout=120)
    assert job.returncode != 0, job.output
    assert "needs MPI_THREAD_MULTIPLE" in job.output, job.output


# --- layering -------------------------------------------------------------------------------
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def test_the_import_contracts_hold():
    proc = subprocess.run([LINT_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 5 kept, 0 broken" in proc.stdout, proc.stdout


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


def test_there_is_one_training_loop():
    fits = [p for p in (ROOT / "hpctrain").rglob("*.py") if "def fit(" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in fits] == ["hpctrain/loop.py"]
