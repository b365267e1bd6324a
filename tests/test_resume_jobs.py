"""Checkpoints in real training jobs: bit-exact resume, kill -9 during a save, other world
sizes, other backends, and clear refusals on every rank."""

import json
import math
import re
import shutil

import numpy as np
import pytest
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun

from hpctrain.checkpoint import find_latest_valid, list_checkpoints, load, verify

SCRIPT = str(ROOT / "tests" / "scripts" / "train_dump.py")
BASE = [
    "data.train_samples=640",
    "data.val_samples=128",
    "train.log_every=1",
    "train.epochs=2",
    "train.batch_size=16",
    "model.hidden=[32]",
    "optimizer.lr_scaling=none",
    "metrics.tensorboard=false",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=null",
    "checkpoint.shard_min_mb=0.001",  # the small model's state still goes to every rank's file
]


def _run(tmp_path, name, np_, run_dir, *overrides, resume=None, env=None, ok=True):
    out = tmp_path / f"{name}.npz"
    args = [SCRIPT, str(out), "--run-dir", str(run_dir)]
    if resume:
        args += ["--resume", resume]
    for o in [*BASE, *overrides]:
        args += ["--set", o]
    job = mpirun(np_, PYTHON, *args, timeout=300, env=env)
    if ok:
        assert job.returncode == 0, job.output
        with np.load(out) as f:
            return {k: f[k] for k in f.files}, job
    return None, job


def _run_in_one_launch(tmp_path, np_, runs):
    """Several runs one after the other in one launch (train_dump.py's --next: each run
    reseeds the process, so it equals a fresh one); their weights, in order."""
    args = [SCRIPT]
    for name, run_dir, overrides in runs:
        args += ["--next"] if len(args) > 1 else []
        args += [str(tmp_path / f"{name}.npz"), "--run-dir", str(run_dir)]
        for o in [*BASE, *overrides]:
            args += ["--set", o]
    job = mpirun(np_, PYTHON, *args, timeout=300)
    assert job.returncode == 0, job.output
    out = []
    for name, _, _ in runs:
        with np.load(tmp_path / f"{name}.npz") as f:
            out.append({k: f[k] for k in f.files})
    return out


def _step_losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return {x["step"]: x["loss"] for x in lines if x["event"] == "step"}


def _epoch_records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return [(x["epoch"], x["loss"], x.get("val_loss")) for x in lines if x["event"] == "epoch"]


# Each backend and each engine once (the kill is in the checkpoint writer, which no backend
# or engine touches; every pair took 51 s of the suite, these two 28 s).
@pytest.mark.parametrize("backend, engine", [("torch", "mpi"), ("tensorflow", "horovod")])
def test_interrupted_run_resumes_bit_for_bit_even_after_kill_during_save(tmp_path, backend, engine):
    common = [
        f"backend={backend}",
        "optimizer.name=adam",
        "optimizer.lr=0.003",
        f"train.allreduce={engine}",
    ]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    # The uninterrupted run, then 1.: train 30 steps and stop (checkpoints at 10, 20, 30);
    # one launch (a Horovod job retires the warm ranks: each launch starts cold)
    ref, _ = _run_in_one_launch(
        tmp_path,
        2,
        [("ref", ref_dir, common), ("part1", run_dir, [*common, "train.max_steps=30"])],
    )
    # 2. Resume, then die by SIGKILL in the middle of writing the step-40 checkpoint.
    _, job = _run(
        tmp_path,
        "part2",
        2,
        run_dir,
        *common,
        resume="auto",
        env={"HPCTRAIN_FAULT_KILL_DURING_SAVE": "0:2"},
        ok=False,
    )
    assert job.returncode != 0
    ckpt_dir = run_dir / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpt_dir)] == [10, 20, 30]
    # step 20 ends epoch 0: its save waited for the epoch's end, so it starts epoch 1
    assert {k: load(ckpt_dir / "ckpt-00000020.h5").trainer[k] for k in ("epoch", "position")} == {
        "epoch": 1,
        "position": 0,
    }
    # rank 0 died writing its shard of the (sharded) step-40 checkpoint: no commit
    shards = ckpt_dir / "ckpt-00000040.shards"
    assert any(p.name.startswith(".shard-00000-of-00002.h5.tmp") for p in shards.iterdir())
    assert verify(ckpt_dir / "ckpt-00000030.h5").step == 30
    assert find_latest_valid(ckpt_dir).step == 30
    # 3. Resume again: from step 30, to the end.
    final, job = _run(tmp_path, "part3", 2, run_dir, *common, resume="auto")
    assert "resumed from" in job.output and "ckpt-00000030.h5" in job.output
    for k in ref:
        np.testing.assert_array_equal(final[k], ref[k], err_msg=k)  # bit for bit
    assert not any(".tmp" in p.name for p in ckpt_dir.rglob("*"))  # the crash's leftover is gone
    assert sorted(p.name for p in (ckpt_dir / "ckpt-00000040.shards").iterdir()) == [
        "shard-00000-of-00002.h5",
        "shard-00001-of-00002.h5",
    ]
    ref_losses, losses = _step_losses(ref_dir), _step_losses(run_dir)
    assert len(ref_losses) == 40  # 2 epochs x 640 / (16 x 2)
    assert losses == ref_losses  # every step's loss identical, before and after the resume
    # the resumed epoch's record averages all its steps (the checkpoint carries the sums)
    assert _epoch_records(run_dir)[-1] == _epoch_records(ref_dir)[-1]
    assert [e for e, *_ in _epoch_records(run_dir)].count(0) == 1


@pytest.mark.parametrize("layout", ["checkpoint.sharded=false", "checkpoint.async=true"])
def test_a_checkpoint_write_longer_than_the_collective_timeout_is_waited_for(tmp_path, layout):
    """Rank 0 writes the file 4.5 s late, under a 3 s collective timeout: the other rank
    waits for the write under checkpoint.write_timeout (the barrier after a synchronous
    save, the one after an asynchronous run's last write) instead of in its next
    collective, which ended the job as a stall and lost the checkpoint."""
    run_dir = tmp_path / "run"
    sets = [layout, "train.max_steps=2", "checkpoint.every_steps=2"]
    sets += ["runtime.collective_timeout=3", "checkpoint.write_timeout=60"]
    slow = {"HPCTRAIN_FAULT_WRITE_DELAY": "0:4.5"}
    _, job = _run(tmp_path, "slow-write", 2, run_dir, *sets, env=slow)
    assert "watchdog" not in job.output, job.output
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2], job.output


@pytest.mark.parametrize("backend,ranks", [("torch", 1), ("tensorflow", 2)])
def test_async_checkpoints_hold_their_step_and_resume_bit_for_bit(tmp_path, backend, ranks):
    """checkpoint.async: training goes on while the file is written, from a copy taken
    at the save (torch exports views of its live tensors, copied into reused buffers
    while the next step computes, before its update; 2 ranks gather onto rank 0, one
    file). Resuming from the step-20 file of such a run
    ends bit for bit where the run itself ended: the file held step 20's state."""
    common = [f"backend={backend}", "optimizer.name=adam", "optimizer.lr=0.003"]
    common += ["checkpoint.async=true", "checkpoint.sharded=false", "train.max_steps=40"]
    run_dir = tmp_path / "run"
    # each file written 0.3 s late, while training goes on (several steps of this model)
    # and torch's copy of its live tensors, made during the next step, starts 0.3 s late:
    # the step's update must wait for it (the backend's fence)
    late = {"HPCTRAIN_FAULT_WRITE_DELAY": "0:0.3", "HPCTRAIN_FAULT_COPY_DELAY": "0:0.3"}
    ref, job = _run(tmp_path, "ref", ranks, run_dir, *common, env=late)
    ckpts = run_dir / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [10, 20, 30, 40]
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpts / "ckpt-00000020.h5", again / "checkpoints")
    shutil.copy(run_dir / "config.yaml", again / "config.yaml")
    final, job = _run(tmp_path, "again", ranks, again, *common, resume="auto")
    assert "ckpt-00000020.h5" in job.output, job.output
    for k in ref:
        np.testing.assert_array_equal(final[k], ref[k], err_msg=k)  # bit for bit
    losses, ref_losses = _step_losses(again), _step_losses(run_dir)
    assert sorted(losses) == list(range(21, 41))
    assert all(losses[s] == ref_losses[s] for s in losses)


def _resume_from_per_rank_files(tmp_path, run_dir, step: int, ref: dict, *common) -> str:
    """Both ranks' own files are in run_dir's step-`step` checkpoint; a copy of that
    checkpoint alone, resumed with --resume auto at 2 ranks, ends bit for bit where
    run_dir's run did (`ref`: its final weights). The resumed job's output."""
    ckpts, name = run_dir / "checkpoints", f"ckpt-{step:08d}"
    names = sorted(p.name for p in (ckpts / f"{name}.shards").iterdir())
    assert [n for n in names if n.startswith("rank-state")] == [
        "rank-state-00000-of-00002.h5",
        "rank-state-00001-of-00002.h5",
    ]
    assert verify(ckpts / f"{name}.h5").step == step  # their digests too
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpts / f"{name}.h5", again / "checkpoints")
    shutil.copytree(ckpts / f"{name}.shards", again / "checkpoints" / f"{name}.shards")
    shutil.copy(run_dir / "config.yaml", again / "config.yaml")
    final, job = _run(tmp_path, "again", 2, again, *common, resume="auto")
    assert f"{name}.h5" in job.output, job.output
    for k in ref:
        np.testing.assert_array_equal(final[k], ref[k], err_msg=k)  # bit for bit
    losses, ref_losses = _step_losses(again), _step_losses(run_dir)
    assert sorted(losses) == list(range(step + 1, max(ref_losses) + 1))
    assert all(losses[s] == ref_losses[s] for s in losses)
    return job.output


@pytest.mark.parametrize(
    "backend,method,layout",
    [("torch", "topk", "sharded"), ("tensorflow", "powersgd", "async")],
)
def test_compressed_runs_resume_bit_for_bit_with_their_residuals(tmp_path, backend, method, layout):
    """Error feedback keeps per-rank memory (what earlier steps did not send; PowerSGD
    also its warm-start factors): each rank writes it to its own file beside the shards,
    committed with the checkpoint, and takes it back at the same world size, so a
    compressed run resumed from step 20 ends bit for bit where it ended uninterrupted.
    At another world size the residuals start from zero, said once."""
    common = [f"backend={backend}", "train.allreduce=mpi", f"train.compression={method}"]
    common += ["compression.ratio=0.05", "compression.warmup_steps=2", "train.max_steps=30"]
    if layout == "async":
        common += ["checkpoint.async=true", "checkpoint.sharded=false"]
    run_dir = tmp_path / "run"
    ref, _ = _run(tmp_path, "ref", 2, run_dir, *common)
    output = _resume_from_per_rank_files(tmp_path, run_dir, 20, ref, *common)
    assert "start from zero" not in output
    again = tmp_path / "again"
    if layout == "sharded":  # one rank: the residuals of 2 ranks do not apply
        one = tmp_path / "one"
        shutil.copytree(again / "checkpoints", one / "checkpoints", ignore=_newer_than_20)
        shutil.copy(run_dir / "config.yaml", one / "config.yaml")
        _, job = _run(tmp_path, "one", 1, one, *common, resume="auto")
        assert job.output.count("error-feedback residuals start from zero") == 1, job.output
        assert "saved at another world size" in job.output
        # a damaged residual file: named by its rank; every rank starts from zero
        hurt = tmp_path / "hurt"
        shutil.copytree(one / "checkpoints", hurt / "checkpoints", ignore=_newer_than_20)
        shutil.copy(run_dir / "config.yaml", hurt / "config.yaml")
        bad = hurt / "checkpoints" / "ckpt-00000020.shards" / "rank-state-00001-of-00002.h5"
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0x40
        bad.write_bytes(bytes(data))
        _, job = _run(tmp_path, "hurt", 2, hurt, *common, resume="auto")
        assert "ckpt-00000020.h5" in job.output, job.output
        assert "rank-state-00001-of-00002.h5" in job.output and "digest mismatch" in job.output
        assert job.output.count("error-feedback residuals start from zero") == 1, job.output


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_local_sgd_resumes_bit_for_bit_with_each_ranks_optimizer_state(tmp_path, backend):
    """Local SGD averages the parameters (every 4 steps, and before a save), never the
    optimizer: each rank's Adam moments are its own. They go to each rank's own file
    beside the shards, so a run resumed from step 10 (between two averages) ends bit for
    bit where it ended uninterrupted; the canonical state's one copy of them made every
    rank but 0 lose its own (the losses parted from step 12 on: 0.007 to 0.14)."""
    common = [f"backend={backend}", "train.allreduce=mpi", "train.sync_every=4"]
    common += ["optimizer.name=adam", "optimizer.lr=0.003", "train.max_steps=20"]
    run_dir = tmp_path / "run"
    ref, _ = _run(tmp_path, "ref", 2, run_dir, *common)
    output = _resume_from_per_rank_files(tmp_path, run_dir, 10, ref, *common)
    assert "one copy of the optimizer" not in output


def _newer_than_20(folder, names):
    return [n for n in names if n.startswith("ckpt-") and not n.startswith("ckpt-00000020")]


def test_checkpoint_from_four_ranks_resumes_on_two_and_one_rank(tmp_path):
    # 4 ranks x batch 8 for 5 steps; then continue with a global batch of 16 either as
    # 2 ranks x 8 or 1 rank x 16. Both must equal one process doing the same math.
    first, ref_first = tmp_path / "np4", tmp_path / "np1-ref"
    _run(tmp_path, "np4", 4, first, "train.max_steps=5", "train.batch_size=8")
    _run(tmp_path, "ref-a", 1, ref_first, "train.max_steps=5", "train.batch_size=32")
    results = {}
    for name, np_, batch, src in [
        ("np2", 2, 8, first),
        ("np1", 1, 16, first),
        ("ref", 1, 16, ref_first),
    ]:
        run = tmp_path / f"cont-{name}"
        shutil.copytree(src / "checkpoints", run / "checkpoints")
        shutil.copy(src / "config.yaml", run / "config.yaml")  # --resume auto checks it
        weights, job = _run(
            tmp_path, name, np_, run, f"train.batch_size={batch}", "train.epochs=1", resume="auto"
        )
        assert "ckpt-00000005.h5" in job.output
        if src is first:
            assert f"resuming a 4-rank checkpoint on {np_} ranks" in job.output
        steps = sorted(_step_losses(run))
        # The data position carried over: 5 x 32 samples done, the rest in steps of 16.
        assert steps == list(range(6, 6 + (640 - 5 * 32) // 16))
        results[name] = weights
    for name in ("np2", "np1"):
        for k in results["ref"]:
            np.testing.assert_allclose(
                results[name][k], results["ref"][k], atol=1e-5, err_msg=f"{name}: {k}"
            )


def test_wrong_architecture_and_corrupt_checkpoints_are_refused_on_every_rank(tmp_path):
    run = tmp_path / "run"
    _run(tmp_path, "a", 2, run, "train.max_steps=20")
    ckpt = run / "checkpoints" / "ckpt-00000020.h5"
    # A different model (in a run directory of its own: `run` holds the [32] run): one
    # line naming the file and the mismatching tensors.
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(tmp_path / "wider"),
        "--resume",
        str(ckpt),
        "--set",
        "model.hidden=[64]",
        "--set",
        "data.train_samples=640",
        timeout=120,
    )
    assert job.returncode == 2, job.output
    assert job.output.count(f"{ckpt}: does not fit this model") == 1, job.output  # agreed: once
    assert "fc1.weight" in job.output
    # A flipped byte: named file, refused; --resume auto falls back to the previous one.
    raw = bytearray(ckpt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(raw))
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(run),
        "--resume",
        str(ckpt),
        "--set",
        "model.hidden=[32]",
        "--set",
        "data.train_samples=640",
        timeout=120,
    )
    assert job.returncode == 2, job.output
    assert job.output.count(str(ckpt)) >= 1, job.output
    _, job = _run(tmp_path, "b", 2, run, "train.max_steps=25", resume="auto")
    resumed_line = [x for x in job.output.splitlines() if "resumed from" in x]
    assert resumed_line and "ckpt-00000010.h5" in resumed_line[0], job.output
    assert "ckpt-00000020.h5" in job.output  # the warning names the damaged file
    # ... and it is kept aside, not replaced by this run's own save of step 20
    (aside,) = (run / "previous").iterdir()
    assert (aside / "ckpt-00000020.h5").read_bytes() == bytes(raw)
    assert (run / "checkpoints" / "ckpt-00000020.h5").read_bytes() != bytes(raw)


@pytest.mark.parametrize("direction", ["torch->tensorflow", "tensorflow->torch"])
@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet", "transformer"])
def test_checkpoint_moves_between_backends_with_the_same_predictions(tmp_path, model, direction):
    from test_zoo_parity import CASES, _batch

    from hpctrain import Config
    from hpctrain.backends.tensorflow import TensorFlowBackend
    from hpctrain.backends.torch import TorchBackend
    from hpctrain.checkpoint import load, save
    from hpctrain.runtime import world

    overrides, inp = CASES[model]
    cfg = Config.load(None, [*overrides, "optimizer.name=adam", "optimizer.lr=0.01"])
    src_cls, dst_cls = (
        (TorchBackend, TensorFlowBackend)
        if direction.startswith("torch")
        else (TensorFlowBackend, TorchBackend)
    )
    src = src_cls(cfg, world(), inp, 1)
    for i in range(2):
        src.train_step([_batch(inp, 8, i)], 0.01)
    path = save(tmp_path, 2, src.export_state(), {"step": 2})
    dst = dst_cls(cfg, world(), inp, 1)
    dst.import_state(load(path).state)
    x, _ = _batch(inp, 8, 99)
    np.testing.assert_allclose(dst.predict(x), src.predict(x), atol=1e-5)
    # The optimizer state came along too: one more identical step stays identical.
    batch = _batch(inp, 8, 7)
    src.train_step([batch], 0.01)
    dst.train_step([batch], 0.01)
    np.testing.assert_allclose(dst.predict(x), src.predict(x), atol=1e-4)


def test_every_steps_auto_follows_the_measured_young_daly_interval(tmp_path):
    """`checkpoint.every_steps: auto`: a first save at step 20 measures the stall, then
    every save sets the next interval, sqrt(2 x stall x MTBF) / step time, the same on
    every rank (a 6 s MTBF makes the interval a few steps here)."""
    run = tmp_path / "run"
    _, job = _run(
        tmp_path, "auto", 2, run,
        "checkpoint.every_steps=auto", "checkpoint.mtbf_hours=0.002",
        "checkpoint.keep_last=null", "checkpoint.every_minutes=null",
        "train.epochs=1", "data.train_samples=4096",
    )  # fmt: skip
    logged = [
        (float(c), float(m), float(sec), int(n), float(s))
        for c, m, sec, n, s in re.findall(
            r"sqrt\(2 x (\S+) s stall x (\S+) s MTBF\) = (\S+) s = (\d+) steps of (\S+) s",
            job.output,
        )
    ]
    saved = sorted(int(x) for x in re.findall(r"ckpt-(\d+)\.h5 \(", job.output))
    assert saved[0] == 20 and len(logged) >= 2, job.output
    for (stall, mtbf, seconds, steps, step_s), a, b in zip(logged, saved, saved[1:-1]):
        assert mtbf == pytest.approx(7.2)
        assert seconds == pytest.approx(math.sqrt(2 * stall * mtbf), rel=0.02)
        assert steps == max(1, round(seconds / step_s)) or abs(steps - seconds / step_s) < 1
        assert b - a == steps, (saved, logged)  # the next save comes that many steps later
    assert saved[-1] - saved[-2] <= logged[len(saved) - 2][3]  # the last: the epoch's end


def test_a_resume_at_a_larger_global_batch_still_trains_every_epoch(tmp_path):
    """1 rank x 16 for 30 steps (epoch 0, sample 480 of 640), then 2 ranks x 16: the
    step counter goes on in the old batch's steps, so the budget is the counter plus
    what finishes the epochs at the new batch (5 + 20 steps: to step 55), not 2 x 20
    (which ended the run at step 40, epoch 1 never trained)."""
    run = tmp_path / "run"
    sets = [w for o in [*BASE, "optimizer.schedule=cosine"] for w in ("--set", o)]
    first = mpirun(
        1, HPCTRAIN, "train", "--run-dir", str(run), *sets, "--set", "train.max_steps=30"
    )
    assert first.returncode == 0, first.output
    capped = tmp_path / "capped"  # the same resume under train.max_steps: said as such
    shutil.copytree(run, capped)
    job = mpirun(2, HPCTRAIN, "train", "--run-dir", str(capped), *sets, "--resume", "auto",
                 "--set", "train.max_steps=33")  # fmt: skip
    assert job.returncode == 0 and "done: steps=33," in job.output, job.output
    assert "end at step 55" in job.output and "spans 33 (train.max_steps) steps" in job.output
    job = mpirun(2, HPCTRAIN, "train", "--run-dir", str(run), *sets, "--resume", "auto")
    assert job.returncode == 0, job.output
    assert "trained at global batch 16 at global batch 32" in job.output, job.output
    assert "the epochs left end at step 55" in job.output, job.output
    assert "the lr schedule spans these 55 steps" in job.output, job.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    assert "done: steps=55, epochs=2," in job.output, job.output
    assert [x["epoch"] for x in lines if x["event"] == "epoch"][-2:] == [0, 1], lines
    steps = [x for x in lines if x["event"] == "step"]
    assert steps[-1]["step"] == 55 and steps[-1]["lr"] < 1e-4, steps[-1]  # annealed
