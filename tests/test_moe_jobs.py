"""Mixture of experts under real mpirun: the expert-parallel layer equals a single-process
reference, the MoE transformer trains in both backends, np=2 equals np=1 when nothing is
dropped, and bad input stops every rank with a clear message."""

import json
import re

import numpy as np
import pytest
import yaml
from dump_runs import train_many
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun
from shared_runs import SharedRuns

from hpctrain.models import zoo

SCRIPTS = ROOT / "tests" / "scripts"
MOE = [
    "model.name=transformer",
    "data.task=tokens",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "data.seq_len=16",
    "data.vocab=32",
    "data.train_samples=1024",
    "data.val_samples=128",
    "train.log_every=1",
    "optimizer.lr_scaling=none",
    "metrics.tensorboard=false",
    "data.prefetch=1",
]


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_expert_parallel_layer_equals_single_process_reference(np_):
    job = mpirun(
        np_, PYTHON, str(SCRIPTS / "moe_layer_check.py"), "torch", "tensorflow", timeout=300
    )
    assert job.returncode == 0, job.output
    for backend in ("torch", "tensorflow"):
        assert f"MOE LAYER OK: {backend}, 4 cases, {np_} rank(s)" in job.output, job.output


def _train_many(tmp_path, np_, runs: dict[str, list[str]], timeout=300, run_dir=None, resume=None):
    """{name: (weights, step lines)} of runs trained in one launch (dump_runs.py);
    moe_train_dump.py checks the dense replicas and gathers every rank's experts."""
    said = rf"DENSE REPLICAS IDENTICAL over {np_} rank\(s\); \d+ expert tensors gathered: "
    results = train_many(
        SCRIPTS / "moe_train_dump.py", tmp_path, np_, runs, base=MOE, timeout=timeout,
        said=lambda out: said + re.escape(str(out)), keep=lambda x: x,
        run_dir=run_dir, resume=resume,
    )  # fmt: skip
    return {name: (weights, steps) for name, (weights, steps, _) in results.items()}


def _train(tmp_path, name, np_, *overrides, run_dir=None, resume=None):
    runs = {name: list(overrides)}
    return _train_many(tmp_path, np_, runs, run_dir=run_dir, resume=resume)[name]


# The runs tests compare, one launch per (ranks, backend) (shared_runs.py).
_SHARED = SharedRuns(_train_many, "moe-np")
share, shared_run = _SHARED.share, _SHARED.get  # (weights, step lines) of a run


BACKENDS = ["torch", "tensorflow"]
CF = 1.25
# TensorFlow's cases of this test and of the checkpoint test below are in `make
# test-extended` (18 s): the routing, capacity and balancing loss are framework-neutral
# code, and `make test` has TensorFlow's experts dropping and balancing like data-parallel
# MoE (test_tensor_parallel_jobs.py, tensorflow-zero3) and its MoE checkpoints resuming
# as one process (test_moe_checkpoints_with_tensor_parallelism_or_zero_resume_...).
BACKEND_CASES = ["torch", pytest.param("tensorflow", marks=pytest.mark.extended)]
for _b in BACKENDS:
    share(2, _b, "trains", f"model.moe={{experts: 4, top_k: 2, capacity_factor: {CF}, "
          "min_capacity: 0}", "train.max_steps=40", "train.epochs=2", "train.batch_size=16",
          "optimizer.name=adam", "optimizer.lr=0.003", extended=_b == "tensorflow")  # fmt: skip


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_moe_transformer_trains_and_respects_capacity(tmp_path_factory, backend):
    cf = CF
    _, steps = shared_run(tmp_path_factory, 2, backend, "trains")
    losses = [s["loss"] for s in steps]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2, losses  # it learns
    for s in steps:
        assert len(s["moe_load"]) == 4 and abs(sum(s["moe_load"]) - 4) < 1e-6
        # 256 tokens per rank: capacity ceil(2*256/4*1.25) = 160 = exactly cf x mean load
        assert s["moe_kept_load_max"] <= cf + 1e-9, s
        assert 0 <= s["moe_drop_rate"] < 0.5 and s["moe_aux_loss"] > 0
        assert 0 < s["moe_alltoall_share"] < 1 and s["moe_tokens_per_sec"] > 0
    # The load-balancing loss keeps routing from collapsing onto one expert.
    assert max(s["moe_load_max"] for s in steps[-10:]) < 2.0, steps[-1]


# Global batch 16 everywhere. np=2: one expert group of 2 ranks. np=4 with
# parallel.expert=2: tokens are exchanged within 2 expert groups of 2 ranks, and each
# expert's 2 copies average their gradients over the grid's data axis (MoE x DP).
# The balancing loss is a product of per-batch means (f_i * P_i), so it is computed
# per rank's batch (as Switch does per core) and is not split-invariant: alpha = 0.
EQUAL = [
    "model.moe={experts: 4, top_k: 2, drop_tokens: false, aux_loss: 0}",
    "train.max_steps=4",
    "optimizer.name=sgd",
    "optimizer.lr=0.1",
    "train.clip_norm=0.5",
]
LAYOUTS = [(2, ["train.batch_size=8"]), (4, ["train.batch_size=4", "parallel.expert=2"])]
share(1, "torch", "equal-np1", *EQUAL, "train.batch_size=16")
for _np, _overrides in LAYOUTS:
    share(_np, "torch", "equal", *EQUAL, *_overrides)
    share(_np, "torch", "equal-gloo", *EQUAL, *_overrides, "train.allreduce=gloo")


@pytest.mark.parametrize("np_,overrides", LAYOUTS, ids=["one-group-of-2", "two-groups-of-2"])
def test_expert_parallel_ranks_equal_one_rank_when_nothing_is_dropped(
    tmp_path_factory, np_, overrides
):
    ref, ref_steps = shared_run(tmp_path_factory, 1, "torch", "equal-np1")
    got, got_steps = shared_run(tmp_path_factory, np_, "torch", "equal")
    if "parallel.expert=2" in overrides:
        run_dir = shared_run(tmp_path_factory, np_, "torch", "equal", run_dir=True)
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert recorded["parallel"]["expert"] == 2
        # every option of the model, defaults too (zoo.written_model): what a resume checks
        assert set(recorded["model"]) == {"name", *zoo.MODEL_OPTIONS["transformer"]}
        assert recorded["model"]["moe"]["every"] == 1  # not set in EQUAL
    assert ref.keys() == got.keys()
    assert sum(".moe.experts." in k for k in ref) == 2 * 4 * 4  # 2 blocks x 4 experts x 4
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(
        [s["loss"] for s in got_steps], [s["loss"] for s in ref_steps], atol=1e-5
    )


@pytest.mark.parametrize("np_,overrides", LAYOUTS, ids=["one-group-of-2", "two-groups-of-2"])
def test_experts_over_gloo_process_groups_equal_them_over_mpi(tmp_path_factory, np_, overrides):
    """train.allreduce=gloo: the token rows travel as tensors over the expert axis's
    process group (all_to_all_single with the routed counts), the experts' gradients
    average over the data axis's group, the dense ones over the job's; the weights and
    losses equal the MPI engine's run of the same layout within 1e-6."""
    mpi, mpi_steps = shared_run(tmp_path_factory, np_, "torch", "equal")
    got, got_steps = shared_run(tmp_path_factory, np_, "torch", "equal-gloo")
    run_dir = shared_run(tmp_path_factory, np_, "torch", "equal-gloo", run_dir=True)
    assert "allreduce: gloo" in (run_dir / "config.yaml").read_text()
    assert mpi.keys() == got.keys()
    for k in mpi:
        np.testing.assert_allclose(got[k], mpi[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(
        [s["loss"] for s in got_steps], [s["loss"] for s in mpi_steps], rtol=0, atol=1e-6
    )
    assert got_steps[-1]["moe_load"] == mpi_steps[-1]["moe_load"]  # the same routing


def test_experts_not_divisible_by_ranks_stops_every_rank(tmp_path):
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        *(a for o in [*MOE, "model.moe={experts: 3, top_k: 1}"] for a in ("--set", o)),
        timeout=120,
    )
    assert job.returncode == 2, job.output
    msg = "model.moe.experts=3 cannot be split evenly over 2 expert-parallel ranks"
    assert job.output.count("rank(s) 0-1: " + msg) == 1, job.output  # agreed: said once


def test_bad_moe_config_is_reported_on_every_rank(tmp_path):
    job = mpirun(
        2,
        HPCTRAIN,
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        *(a for o in [*MOE, "model.moe={experts: 2, top_k: 2, capacity_factor: 0}"]
          for a in ("--set", o)),
        timeout=120,
    )  # fmt: skip
    assert job.returncode == 2, job.output
    assert job.output.count("model.moe.capacity_factor: must be a number > 0") == 1, job.output


def _manifest(path) -> dict:
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f["manifest"][()].tobytes())


CKPT = [
    "model.moe={experts: 4, top_k: 2, drop_tokens: false, aux_loss: 0}",
    # SGD with momentum (a slot to checkpoint): Adam would turn the key bias's
    # rounding-noise gradients into full steps, different at each layout.
    "optimizer.name=sgd",
    "optimizer.lr=0.1",
    "optimizer.momentum=0.9",
    "train.clip_norm=0.5",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=null",
    "train.epochs=1",
]
for _b in BACKENDS:
    _ext = _b == "tensorflow"  # its test is extended (above)
    share(1, _b, "ckpt-np1", *CKPT, "train.batch_size=16", "train.max_steps=6", extended=_ext)
    share(2, _b, "ckpt-np2", *CKPT, "train.batch_size=8", "train.max_steps=6", extended=_ext)
    share(2, _b, "ckpt-part1", *CKPT, "train.batch_size=8", "train.max_steps=3", extended=_ext)


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_moe_checkpoints_resume_bit_for_bit_and_on_another_expert_layout(
    tmp_path, tmp_path_factory, backend
):
    """Experts live on different ranks: each rank writes its experts' weights and
    optimizer slots under canonical names to its own shard file (sharded, the default),
    or rank 0 gathers them into one file. A 2-rank run stopped at step 3 resumes on 2
    ranks bit for bit, and on 4 ranks as 2 expert groups x 2 replicas (resharded by
    name) equal to one process, as the uninterrupted runs are. The resumed runs start
    fresh processes; the others share their launch with other tests' runs."""
    import shutil

    common = [f"backend={backend}", *CKPT]
    ref, _ = shared_run(tmp_path_factory, 1, backend, "ckpt-np1")
    whole, _ = shared_run(tmp_path_factory, 2, backend, "ckpt-np2")
    first = shared_run(tmp_path_factory, 2, backend, "ckpt-part1", run_dir=True)
    assert (first / "checkpoints" / "ckpt-00000003.h5").exists()
    shards = sorted((first / "checkpoints" / "ckpt-00000003.shards").glob("shard-*.h5"))
    assert [p.name for p in shards] == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"]
    expert_files = {p.name for p in shards if "experts" in json.dumps(_manifest(p))}
    assert len(expert_files) == 2  # every rank wrote its own experts
    results = {}
    for name, np_, extra in [
        ("again-np2", 2, ["train.batch_size=8"]),
        ("resharded-np4", 4, ["train.batch_size=4", "parallel.expert=2"]),
    ]:
        run = tmp_path / name
        shutil.copytree(first / "checkpoints", run / "checkpoints")
        shutil.copy(first / "config.yaml", run / "config.yaml")
        results[name], steps = _train(
            tmp_path, name, np_, *common, *extra, "train.max_steps=6", run_dir=run,
            resume="auto",
        )  # fmt: skip
        assert [s["step"] for s in steps] == [4, 5, 6]
    for k in whole:
        np.testing.assert_array_equal(results["again-np2"][k], whole[k], err_msg=k)
        np.testing.assert_allclose(results["resharded-np4"][k], ref[k], atol=1e-5, err_msg=k)
