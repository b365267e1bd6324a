"""A new user's first hour (issue 18), under real mpirun: their data, their models, their
terminal. Each job is small (2 ranks, a few steps); refusals are one line, said once."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import HPCTRAIN, ROOT, mpirun
from signalled_runs import sets, stop_after_steps

TESTS = ROOT / "tests"
QUICK = ["metrics.tensorboard=false", "checkpoint.enabled=false", "train.log_every=1"]
BACKENDS = ["torch", "tensorflow"]


def _sets(*overrides: str, quick=QUICK) -> list[str]:
    out = []
    for o in [*quick, *overrides]:
        out += ["--set", o]
    return out


def train(run_dir: Path, *overrides: str, np_=2, cwd=None, env=None, timeout=240):
    job = mpirun(
        np_,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(run_dir),
        *_sets(*overrides),
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.open()] if metrics.exists() else []
    return job, lines


def last_epoch(lines: list[dict]) -> dict:
    return [x for x in lines if x["event"] == "epoch"][-1]


def assert_one_clear_line(job, message: str, times=(1,)):
    """Exit status 2-ish, the message said `times` times, and no traceback."""
    assert job.returncode != 0, job.output
    assert job.output.count(message) in times, job.output
    assert "Traceback" not in job.output, job.output
    line = next(x for x in job.output.splitlines() if message in x)
    assert len(line) < 600, line


# --- data as users have it ------------------------------------------------------------------
def teacher_vectors(n=1200, features=20, classes=3, seed=0):
    """Gaussian vectors labelled by a random linear teacher: learnable by an mlp."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, classes))
    x = rng.normal(size=(n, features))
    return x, np.argmax(x @ w, axis=1)


def write(path: Path, **datasets) -> Path:
    attrs = datasets.pop("attrs", {})
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key.replace("__", "/")] = value
        f.attrs.update(attrs)
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_features_and_int32_labels_train(tmp_path, backend):
    """numpy's defaults (float64 x, int32 / (n, 1) labels) in /x + /y, no validation split."""
    x, y = teacher_vectors()
    path = write(tmp_path / "numpy.h5", x=x, y=y.astype(np.int32)[:, None])
    job, lines = train(
        tmp_path / "run",
        f"backend={backend}",
        "data.source=hdf5",
        f"data.path={path}",
        "train.epochs=3",
        "train.batch_size=32",
    )
    assert job.returncode == 0, job.output
    epoch = last_epoch(lines)
    assert epoch["val_samples"] == 120  # 10% held out of /x, no file split needed
    assert epoch["val_accuracy"] > 0.6, epoch  # chance is 1/3
    for noise in ("cpu_feature_guard", "oneDNN", "absl::InitializeLog", "MPI_ABORT"):
        assert noise not in job.output, noise


def images(n=600, classes=3, size=12, seed=0):
    """8-bit colour images (N, C, H, W): each class tints one channel, under noise and a
    random smooth pattern shared by all classes."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1, 1))
    pattern = np.sin(2 * np.pi * (xx + yy)[None, None] / size + phase)
    x = rng.normal(0, 1, (n, 3, size, size)) + pattern
    x[np.arange(n), y % 3] += 0.8
    pixels = np.clip((x + 3.0) / 6.0 * 255.0, 0, 255).astype(np.uint8)
    return pixels, y.astype(np.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nhwc_uint8_images_train_exactly_as_nchw(tmp_path, backend):
    """The same images stored channels last train to the same numbers as channels first."""
    x, y = images()
    nchw = write(tmp_path / "nchw.h5", images=x, labels=y)
    nhwc = write(tmp_path / "nhwc.h5", images=x.transpose(0, 2, 3, 1), labels=y)
    results = {}
    for name, path in (("nchw", nchw), ("nhwc", nhwc)):
        job, lines = train(
            tmp_path / name,
            f"backend={backend}",
            "model.name=cnn",
            "model.channels=[8, 16]",
            "data.source=hdf5",
            f"data.path={path}",
            "train.epochs=3",
            "train.batch_size=16",
            "optimizer.name=adam",
            "optimizer.lr=0.01",
            "optimizer.lr_scaling=none",
        )
        assert job.returncode == 0, job.output
        results[name] = last_epoch(lines)
    a, b = results["nchw"], results["nhwc"]
    assert a["val_accuracy"] == b["val_accuracy"], results
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), results
    assert a["val_accuracy"] > 0.5, a  # learned: chance is 1/3


def test_refusals_name_what_to_change_once(tmp_path):
    """Each refused file: one line, said once (not once per rank), no traceback."""
    x, y = teacher_vectors(200)
    cases = [
        (
            write(
                tmp_path / "range.h5",
                x=x,
                y=np.where(np.arange(200) == 17, 5, y),
                attrs={"classes": 3},
            ),
            [],
            "/y row 17 holds 5, outside 0..2 (3 classes, the file's attribute classes)",
        ),
        (
            write(tmp_path / "tokens.h5", x=(x * 10).astype(np.int32), y=y),
            ["model.name=first_hour_models:torch_sized"],
            "/x holds int32 and first_hour_models:torch_sized is your own model: set data.tokens",
        ),
        (
            write(tmp_path / "frac.h5", x=x, y=y + 0.5),
            [],
            "/y row 0 holds 0.5, not a whole number",
        ),
        (
            write(tmp_path / "onehot.h5", x=x, y=np.eye(3)[y]),
            [],
            "which looks one-hot: store class indices (np.argmax(y, axis=1))",
        ),
        (
            write(tmp_path / "names.h5", feats=x, targets__cls=y),
            [],
            "it holds /feats (200, 20) float64, /targets/cls (200,) int64; set data.keys",
        ),
        (
            write(tmp_path / "cube.h5", images=np.zeros((40, 3, 3, 3), np.uint8), labels=y[:40]),
            ["model.name=cnn", "data.task=images"],
            "cannot tell the image layout: samples (3, 3, 3) could be channels first or "
            "channels last; set data.layout to nchw or nhwc",
        ),
    ]
    for i, (path, extra, message) in enumerate(cases):
        job, _ = train(
            tmp_path / f"run{i}", "data.source=hdf5", f"data.path={path}", *extra, cwd=TESTS
        )
        assert job.returncode == 2, job.output
        assert_one_clear_line(job, message)
        assert "MPI_ABORT" not in job.output  # agreed on every rank: plain exit codes


def test_configurable_keys_and_layout_are_honoured(tmp_path):
    """data.keys names the datasets; data.layout: nhwc settles an ambiguous shape."""
    x, y = images(200)
    cube = x[:, :, :3, :3]  # (3, 3, 3) samples: ambiguous unless declared
    path = write(
        tmp_path / "odd.h5", pics__train=cube, lab__train=y, pics__val=cube[:40], lab__val=y[:40]
    )
    keys = (
        "data.keys={train_x: /pics/train, train_y: /lab/train, val_x: /pics/val, val_y: /lab/val}"
    )
    job, lines = train(
        tmp_path / "run",
        "data.source=hdf5",
        f"data.path={path}",
        keys,
        "data.layout=nhwc",
        "model.name=cnn",
        "model.channels=[4]",
        "train.max_steps=3",
        "train.batch_size=16",
    )
    assert job.returncode == 0, job.output
    assert last_epoch(lines)["val_samples"] == 40


# --- models that plug in ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_user_model_from_the_current_directory_is_sized_from_the_data(tmp_path, backend):
    """No PYTHONPATH: the module sits in the directory hpctrain starts from; the function
    gets input_shape and the number of classes (20 features, 3 classes here)."""
    x, y = teacher_vectors()
    path = write(tmp_path / "d.h5", x=x.astype(np.float32), y=y)
    fn = "torch_sized" if backend == "torch" else "keras_sized"
    env = {"PYTHONPATH": ""}
    job, lines = train(
        tmp_path / "run",
        f"backend={backend}",
        f"model.name=first_hour_models:{fn}",
        "model.width=32",
        "data.source=hdf5",
        f"data.path={path}",
        "train.epochs=3",
        "train.batch_size=32",
        cwd=TESTS,
        env=env,
    )
    assert job.returncode == 0, job.output
    assert last_epoch(lines)["val_accuracy"] > 0.6


USER_MODEL_PROBLEMS = [
    (
        "torch",
        ["model.name=nosuchpkg.nets:build"],
        "cannot import 'nosuchpkg.nets' (no module named 'nosuchpkg' on this rank's path): "
        "put its directory on PYTHONPATH on every rank (mpirun -x PYTHONPATH=...",
    ),
    (
        "torch",
        ["model.name=first_hour_models:torch_sized", "model.hidden=[64]"],
        "torch_sized has no parameter for model.hidden (its parameters: input_shape, "
        "classes, width)",
    ),
    (
        "torch",
        ["model.name=first_hour_models:broken"],
        "broken() raised ValueError: width 8 is not supported",
    ),
    (
        "torch",
        ["model.name=first_hour_models:torch_fixed"],
        "a forward pass on a batch of shape (2, 20) failed: RuntimeError: mat1 and mat2 "
        "shapes cannot be multiplied (2x20 and 32x8)",
    ),
    (
        "tensorflow",
        ["model.name=first_hour_models:keras_fixed"],
        "a forward pass on a batch of shape (2, 20) failed",
    ),
    (
        "torch",
        ["model.name=first_hour_models:torch_fixed", "data.keys={train_x: /x32, train_y: /y}"],
        "output shape (2, 10) for a batch of shape (2, 32), but the data needs (2, 3) (3 classes)",
    ),
    (
        "tensorflow",
        ["model.name=first_hour_models:keras_fixed", "data.keys={train_x: /x32, train_y: /y}"],
        "output shape (2, 10) for a batch of shape (2, 32), but the data needs (2, 3) (3 classes)",
    ),
]


@pytest.mark.parametrize("backend, overrides, message", USER_MODEL_PROBLEMS)
def test_user_model_problems_are_one_line(tmp_path, backend, overrides, message):
    x, y = teacher_vectors(200)
    x32 = np.concatenate([x, np.zeros((200, 12))], axis=1)
    path = write(tmp_path / "d.h5", x=x, x32=x32, y=y)
    job, _ = train(
        tmp_path / "run",
        f"backend={backend}",
        "data.source=hdf5",
        f"data.path={path}",
        *overrides,
        cwd=TESTS,
        env={"PYTHONPATH": ""},
        timeout=180,
    )
    assert job.returncode != 0
    # Until the strategies agree on model errors over ranks, each failing rank may print
    # its line before MPI_Abort ends the job: at most one line per rank.
    assert_one_clear_line(job, message, times=(1, 2))


def test_a_configuration_refused_on_one_rank_only_is_agreed_not_a_hang(tmp_path):
    """Rank 1 alone gets a bad --set (an mpirun app context of its own, a node's own copy
    of the file): it starts MPI with the Open MPI settings its peers start with, so the
    agreed error comes. It started MPI without them, and both ranks spun in MPI's first
    communicator split until killed."""
    bad = 'X=""; if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then X="--set train.zero=banana"; fi; '
    run = tmp_path / "run"
    script = f"{bad}exec {HPCTRAIN} train --run-dir {run} --set train.max_steps=1 $X"
    job = mpirun(2, "bash", "-c", script, timeout=60)
    assert job.returncode == 2, job.output
    assert "rank(s) 1: invalid configuration" in job.output, job.output
    assert "train.zero: expected int, got str 'banana'" in job.output, job.output


def test_zoo_options_left_over_from_another_model_are_named(tmp_path):
    config = tmp_path / "mlp.yaml"
    config.write_text("model:\n  name: mlp\n  hidden: [64, 64]\n")
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--config",
        str(config),
        "--set",
        "model.name=cnn",
        "--set",
        "data.task=images",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert job.returncode == 2
    assert_one_clear_line(job, "model.hidden: not an option of cnn (its options: channels)")
    assert "--set 'model={name: cnn}' replaces the whole section" in job.output  # the way out


# --- the terminal -----------------------------------------------------------------------------
@pytest.mark.parametrize("launch", ["plain", "mpirun"])
def test_ctrl_c_writes_a_checkpoint_then_stops_with_and_without_mpirun(tmp_path, launch):
    run = tmp_path / "run"
    cmd = [HPCTRAIN, "train", "--run-dir", str(run), *sets()]
    if launch == "mpirun":
        cmd = ["mpirun", "-np", "2", *cmd]
    _, out = stop_after_steps(cmd, run, signal.SIGINT, group=True)  # Ctrl-C: the whole group
    # mpirun passes Ctrl-C on to its ranks as SIGTERM; alone, the process gets SIGINT
    name = "SIGTERM" if launch == "mpirun" else "SIGINT"
    assert f"{name} received: stopped at step" in out, out
    assert "Traceback" not in out and "MPI_ABORT" not in out, out
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    assert checkpoints, out
    summary = [json.loads(x) for x in (run / "metrics.jsonl").open()][-1]
    assert summary["event"] == "summary" and summary["preempted"] == name, summary
    assert int(checkpoints[-1].stem.split("-")[1]) == summary["steps"]


def test_progress_bar_on_rank_0_under_mpirun_in_a_terminal(tmp_path):
    """mpirun in a terminal: rank 0 draws tqdm's bar though its own stderr is a pipe."""
    if not shutil.which("mpirun"):
        pytest.skip("mpirun not found")
    cmd = ["mpirun", "-np", "2", HPCTRAIN, "train", "--run-dir", str(tmp_path / "run")]
    cmd += _sets("train.max_steps=20", "data.train_samples=4096", "train.batch_size=32")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("HPCTRAIN_PROGRESS", None)
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        cmd, stdin=sub, stdout=sub, stderr=sub, env=env, cwd=ROOT, start_new_session=True
    )
    os.close(sub)
    chunks, deadline = [], time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # the terminal closed: every writer is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text
    assert "20/20" in text and "step/s" in text, text  # tqdm's bar, drawn to the end
    # and without a terminal (a batch job's log) no bar, only log lines
    job, _ = train(tmp_path / "run2", "train.max_steps=3", "data.train_samples=1024")
    assert job.returncode == 0 and "step/s" not in job.output, job.output
