"""`train.zero: 1 | 2` under real mpirun: sharded optimizer state (and gradients) give the
parameters of plain data parallelism (SGD with momentum and Adam, clipping by the global
norm, accumulation, several segments), in both backends; the optimizer state per rank
is 1/N of the replicated one; checkpoints stay canonical, so a ZeRO run resumes as plain
data parallelism, at another world size and in the other backend."""

import json
import shutil

import numpy as np
import pytest
from test_resume_jobs import _run, _step_losses
from test_trainer_jobs import _assert_same_weights, _train, share, shared_run

COMMON = ["train.max_steps=5", "model.hidden=[64, 32]", "train.batch_size=8"]
TORTURE = [
    "train.grad_accum=2",
    "train.clip_norm=0.05",  # small enough to clip: the norm must be the global one
    "train.bucket_mb=0.004",  # ~4 KB segments: stage 2 reduces several during backward
    "train.zero_unit_mb=0.004",  # stage 3: one layer per unit, each gathered ahead of use
    "train.allreduce=mpi",
    "optimizer.weight_decay=0.01",
    "runtime.memory_limit_mb=100000",  # the pre-flight memory plan runs (and passes)
]


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]


CASES = [
    ("torch", 2, "sgd", 1),
    ("torch", 4, "adam", 2),
    ("tensorflow", 2, "adam", 2),
    ("tensorflow", 4, "sgd", 1),
    ("torch", 2, "sgd", 3),
    ("torch", 4, "adam", 3),
]
for _backend, _np, _optimizer, _stage in CASES:  # in the launches other tests' runs share
    _opts = [f"optimizer.name={_optimizer}", *COMMON, *TORTURE]
    if _optimizer == "sgd":
        _opts.append("optimizer.momentum=0.9")
    else:
        # Adam's default here (lr 0.05) turns last-bit differences of the clip coefficient
        # (torch sums per-parameter float32 norms, the shards a float64 sum) into 1e-6
        # steps on near-zero gradients; at a usual Adam lr they stay below 1e-7.
        _opts.append("optimizer.lr=0.003")
    if _stage != 3:  # stage 3's cases reuse the plain runs of stage 1 and 2's
        share(_np, _backend, f"plain-{_optimizer}", *_opts)
    share(_np, _backend, f"zero{_stage}-{_optimizer}", *_opts, f"train.zero={_stage}")


@pytest.mark.parametrize("backend, np_, optimizer, stage", CASES)
def test_zero_equals_plain_data_parallel(tmp_path_factory, backend, np_, optimizer, stage):
    def run(name, run_dir=False):
        return shared_run(tmp_path_factory, np_, backend, name, run_dir=run_dir)

    plain, plain_losses = run(f"plain-{optimizer}")
    zero, zero_losses = run(f"zero{stage}-{optimizer}")
    _assert_same_weights(zero, plain, 1e-6)
    assert zero_losses == pytest.approx(plain_losses, abs=1e-6)
    steps = [x for x in _metrics(run(f"zero{stage}-{optimizer}", True)) if x["event"] == "step"]
    # Reduce-scatter + allgather: what a ring allreduce sends, 2 (N-1)/N of the vector;
    # stage 2 reduce-scatters every micro-batch (grad_accum=2): 3 (N-1)/N.
    if stage == 3:
        return  # test_zero3_gathers_each_unit_ahead_of_use counts its traffic
    psi = steps[-1]["zero_model_param_bytes"]
    times = 2 if stage == 1 else 3
    assert steps[-1]["comm_bytes"] == pytest.approx(times * (np_ - 1) / np_ * psi, rel=0.01)


@pytest.mark.parametrize("backend", ["torch"])
def test_zero_memory_per_rank_is_the_replicated_over_n(tmp_path, backend):
    """Adam (2 slots) on a 6-layer MLP at np=4 with 20 KB segments: optimizer state per
    rank = replicated / 4 within 1%; stage 2 holds no more gradient than the shard, one
    segment and the gradient being copied. (TensorFlow's tape holds every gradient; its
    figures are in the bench's memory section.)"""
    opts = [
        f"backend={backend}",
        "optimizer.name=adam",
        "train.max_steps=3",
        "model.hidden=[128, 128, 128, 128, 128, 128]",
        "train.batch_size=8",
        "train.allreduce=mpi",
        "train.bucket_mb=0.02",
    ]
    _train(tmp_path, "plain", 4, *opts)
    _train(tmp_path, "zero2", 4, *opts, "train.zero=2")
    plain = [x for x in _metrics(tmp_path / "plain.npz.run") if x["event"] == "step"][-1]
    zero = [x for x in _metrics(tmp_path / "zero2.npz.run") if x["event"] == "step"][-1]
    assert zero["mem_param_bytes"] == pytest.approx(plain["mem_param_bytes"], rel=1e-3)  # + pads
    assert zero["mem_optimizer_bytes"] == pytest.approx(plain["mem_optimizer_bytes"] / 4, rel=0.01)
    assert zero["mem_optimizer_bytes"] == zero["zero_model_optimizer_bytes"]
    replicated = plain["mem_param_bytes"]  # one float32 gradient per parameter
    if backend == "torch":
        largest_param = 128 * 128 * 4
        segment = max(0.02 * 2**20, largest_param) + largest_param
        assert zero["mem_grad_bytes"] <= replicated / 4 + segment + largest_param
        assert zero["mem_grad_bytes"] < 0.7 * replicated
    assert zero["mem_peak_rss_bytes"] > 0


def test_zero_checkpoint_resumes_as_plain_at_another_size_and_in_the_other_backend(tmp_path):
    """ZeRO-2 torch at np=4 checkpoints at step 5; the run continues (a) as plain data
    parallelism at np=2, (b) as ZeRO-1 in TensorFlow at np=2; both equal one process
    doing the same math from the start."""
    common = ["optimizer.name=adam", "optimizer.lr=0.003", "train.allreduce=mpi"]
    first, ref_first = tmp_path / "zero-np4", tmp_path / "np1-ref"
    _run(
        tmp_path,
        "np4",
        4,
        first,
        *common,
        "train.max_steps=5",
        "train.batch_size=8",
        "train.zero=2",
        "train.bucket_mb=0.004",
    )
    # every rank wrote the optimizer state it owns to its own shard file
    shards = first / "checkpoints" / "ckpt-00000005.shards"
    assert sorted(p.name for p in shards.iterdir()) == [
        f"shard-{r:05d}-of-00004.h5" for r in range(4)
    ]
    _run(tmp_path, "ref-a", 1, ref_first, *common, "train.max_steps=5", "train.batch_size=32")
    results = {}
    for name, np_, extra, src in [
        ("plain-np2", 2, ["train.zero=0"], first),
        ("tf-zero1-np2", 2, ["backend=tensorflow", "train.zero=1"], first),
        ("ref", 1, [], ref_first),
    ]:
        run = tmp_path / f"cont-{name}"
        shutil.copytree(src / "checkpoints", run / "checkpoints")
        shutil.copy(src / "config.yaml", run / "config.yaml")
        batch = 16 // np_
        weights, job = _run(
            tmp_path,
            name,
            np_,
            run,
            *common,
            *extra,
            f"train.batch_size={batch}",
            "train.epochs=1",
            resume="auto",
        )
        assert "ckpt-00000005.h5" in job.output
        assert sorted(_step_losses(run))[0] == 6
        results[name] = weights
    for name in ("plain-np2", "tf-zero1-np2"):
        for k in results["ref"]:
            np.testing.assert_allclose(
                results[name][k], results["ref"][k], atol=1e-5, err_msg=f"{name}: {k}"
            )


def test_zero_refuses_what_it_cannot_shard(tmp_path):
    from hpctrain.config import Config
    from hpctrain.errors import ConfigError

    for clash in ("train.allreduce=horovod", "train.compression=topk", "train.sync_every=4"):
        with pytest.raises(ConfigError, match="train.zero=1"):
            Config.load(None, ["train.zero=1", clash])
