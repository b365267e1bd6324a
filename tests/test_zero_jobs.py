"""`train.zero: 1 | 2` under real mpirun: sharded optimizer state (and gradients) give the
parameters of plain data parallelism (SGD with momentum and Adam, clipping by the global
norm, accumulation, several segments), in both backends; the optimizer state per rank
is 1/N of the replicated one; checkpoints stay canonical, so a ZeRO run resumes as plain
data parallelism, at another world size and in the other backend."""

import json
import shutil

import numpy as np
import pytest
from test_resume_jobs import BASE, _run, _step_losses
from test_trainer_jobs import _assert_same_weights, _train, _train_many, share, shared_run

from hpctrain.checkpoint import list_checkpoints, load

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
    ("tensorflow", 2, "adam", 3),
    ("tensorflow", 4, "sgd", 3),  # TF runs each unit again in backward, same gathers
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
    zero_metrics = _metrics(run(f"zero{stage}-{optimizer}", True))
    # the end-of-run validation (under ZeRO-3 gathered unit by unit) sees the same model
    plain_val = [
        x["val_loss"] for x in _metrics(run(f"plain-{optimizer}", True)) if "val_loss" in x
    ]
    zero_val = [x["val_loss"] for x in zero_metrics if "val_loss" in x]
    assert zero_val and zero_val == pytest.approx(plain_val, abs=1e-6)
    steps = [x for x in zero_metrics if x["event"] == "step"]
    # Reduce-scatter + allgather: what a ring allreduce sends, 2 (N-1)/N of the vector;
    # stage 2 reduce-scatters every micro-batch (grad_accum=2): 3 (N-1)/N.
    if stage == 3:
        _assert_zero3_step_traffic(steps, zero, np_)
        return
    psi = steps[-1]["zero_model_param_bytes"]
    times = 2 if stage == 1 else 3
    assert steps[-1]["comm_bytes"] == pytest.approx(times * (np_ - 1) / np_ * psi, rel=0.01)


def _assert_zero3_step_traffic(steps, weights, np_):
    """ZeRO-3 with one layer per unit (MLP 32 -> 64 -> 32 -> 10: units 0, 1, 2) in two
    slots (unit u in slot u % 2), two micro-batches per step. A gather sends (N-1)
    pieces of its unit, and a unit still in its slot is not gathered again:

    - micro-batch 1, forward: units 0, 1, 2 (the optimizer changed the shard);
    - backward: 2 and 1 are still in their slots, 0 is gathered (over 2);
    - micro-batch 2, forward: 0 and 1 are in their slots, 2 is gathered (over 0);
    - backward: 0 again;

    and every micro-batch reduce-scatters each unit's gradient once (the shard)."""
    layers = {}
    for name, w in weights.items():
        layer = name.rsplit(".", 1)[0]
        layers[layer] = layers.get(layer, 0) + w.size
    assert list(layers) == ["fc1", "fc2", "head"], list(layers)
    pieces = [-(-size // np_) * 4 for size in layers.values()]  # a unit padded to N
    shard = sum(pieces)
    accum = 2  # TORTURE's train.grad_accum
    gathered = shard + pieces[0] + pieces[2] + pieces[0]
    for x in steps:
        assert x["zero_model_grad_bytes"] == shard, x  # the gradient's shard
        assert x["comm_bytes"] == (np_ - 1) * (gathered + accum * shard), x


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


ZERO3_JOB = [  # a resume test's ZeRO-3 run: Adam over three units, one per layer
    *BASE,
    "backend=torch",
    "model.hidden=[64, 32]",
    "optimizer.name=adam",
    "optimizer.lr=0.003",
    "train.allreduce=mpi",
]
ZERO3 = ["train.zero=3", "train.zero_unit_mb=0.004"]


def _model_ranges(commit) -> dict:
    """{shard file: {model/<name>: (first element, elements, tensor's elements)}} of a
    sharded checkpoint's table: the parameter ranges each rank wrote."""
    import h5py

    with h5py.File(commit, "r") as f:
        table = json.loads(f["manifest"][()].tobytes())["shards"]
    return {
        r["file"]: {
            n: (p[2], p[3], int(np.prod(p[1])))
            for n, p in r["pieces"].items()
            if n.startswith("model/")
        }
        for r in table["files"]
    }


def _assert_ranges_cover_once(ranges: dict, names) -> None:
    """Every `model/<name>` in `names` is cut into ranges that cover it exactly once."""
    for name in names:
        parts = sorted((r[name][0], r[name][1]) for r in ranges.values() if name in r)
        size = next(r[name][2] for r in ranges.values() if name in r)
        ends = [0] + [first + count for first, count in parts]
        assert [first for first, _ in parts] == ends[:-1] and ends[-1] == size, (name, parts)


def test_zero3_interrupted_run_resumes_bit_for_bit_from_sharded_and_async_checkpoints(tmp_path):
    """ZeRO-3 at np 2 (three units, Adam): a run stopped at step 20 resumes from its
    sharded checkpoint, where each rank wrote the parameter ranges it owns, and another
    run's step-20 checkpoint written in the background (checkpoint.async: one file from
    rank 0, gathered by the collective export) resumes too; both end bit for bit where
    the uninterrupted run ended, every step's loss identical. Every step reports the
    same comm_bytes, also the first after the epoch-end evaluation (whose gathers are
    not a step's)."""
    job = [*ZERO3_JOB, *ZERO3]
    first = _train_many(
        tmp_path,
        2,
        {
            "ref": job,  # 2 epochs x 640 / (16 x 2): 40 steps, checkpoints every 10
            "part1": [*job, "train.max_steps=20"],
            "async": [*job, "checkpoint.async=true"],
        },
    )
    ref, ref_dir = first["ref"][0], tmp_path / "ref.npz.run"
    ckpts = tmp_path / "part1.npz.run" / "checkpoints"
    # the default sharded save: each rank wrote its own ranges of the parameters
    ranges = _model_ranges(ckpts / "ckpt-00000020.h5")
    assert sorted(ranges) == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"], ranges
    for file, pieces in ranges.items():
        assert any(count < size for _, count, size in pieces.values()), (file, pieces)
    _assert_ranges_cover_once(ranges, [f"model/{k}" for k in ref])
    # async: one file per save, from rank 0 (a collective gathered it), and the run
    # itself trained as the synchronous one did
    async_ckpts = tmp_path / "async.npz.run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(async_ckpts)] == [10, 20, 30, 40]
    assert not list(async_ckpts.glob("*.shards"))
    for k in ref:
        np.testing.assert_array_equal(first["async"][0][k], ref[k], err_msg=k)
    again = _train_many(
        tmp_path,
        2,
        {
            "resumed": [*job, f"checkpoint.resume={ckpts / 'ckpt-00000020.h5'}"],
            "from-async": [*job, f"checkpoint.resume={async_ckpts / 'ckpt-00000020.h5'}"],
        },
    )
    ref_losses = _step_losses(ref_dir)
    assert sorted(ref_losses) == list(range(1, 41))
    # every step sends the same bytes, but the one after the epoch-end evaluation (step
    # 21): it is not charged the evaluation's gathers, and its forward finds units the
    # evaluation left in their slots (the shard has not changed since), so it sends less
    sent = {x["step"]: x["comm_bytes"] for x in _metrics(ref_dir) if x["event"] == "step"}
    assert {v for k, v in sent.items() if k != 21} == {sent[1]}, sent
    assert sent[21] < sent[1], sent
    for name, (final, _) in again.items():
        for k in ref:
            np.testing.assert_array_equal(final[k], ref[k], err_msg=f"{name}: {k}")
        losses = _step_losses(tmp_path / f"{name}.npz.run")
        assert sorted(losses) == list(range(21, 41)), name
        assert all(losses[s] == ref_losses[s] for s in losses), name


def test_zero3_checkpoints_resume_at_other_sizes_and_stages(tmp_path):
    """ZeRO-3 at np 4 checkpoints at step 5, sharded (each rank its parameter ranges)
    and as one file (checkpoint.sharded=false: gathered onto rank 0); the two files
    hold the same state. The sharded one continues as ZeRO-2 at np 2 and as one plain
    process, the single file as ZeRO-3 at np 2; a ZeRO-1 (np 4) and a plain one-process
    checkpoint continue as ZeRO-3 at np 2. All equal one process doing the same math
    from the start (global batch 32 for 5 steps, then 16)."""
    job = [*ZERO3_JOB, "train.max_steps=5"]
    _train_many(
        tmp_path,
        4,
        {
            "zero3": [*job, *ZERO3, "train.batch_size=8"],
            "zero3-onefile": [*job, *ZERO3, "train.batch_size=8", "checkpoint.sharded=false"],
            "zero1": [*job, "train.zero=1", "train.batch_size=8"],
        },
    )

    def ckpt(name):
        return tmp_path / f"{name}.npz.run" / "checkpoints" / "ckpt-00000005.h5"

    ranges = _model_ranges(ckpt("zero3"))
    assert sorted(ranges) == [f"shard-{r:05d}-of-00004.h5" for r in range(4)], ranges
    assert all(ranges.values()), ranges  # every rank wrote parameter ranges
    onefile = tmp_path / "zero3-onefile.npz.run" / "checkpoints"
    assert not list(onefile.glob("*.shards"))
    sharded, whole = load(ckpt("zero3")).state, load(ckpt("zero3-onefile")).state
    assert sharded.keys() == whole.keys() and any(k.startswith("optimizer/exp_avg/") for k in whole)
    for k in whole:
        np.testing.assert_array_equal(sharded[k], whole[k], err_msg=k)

    def then(source, *overrides):
        return [*ZERO3_JOB, "train.epochs=1", f"checkpoint.resume={ckpt(source)}", *overrides]

    one = _train_many(
        tmp_path,
        1,
        {
            "ref-a": [*job, "train.batch_size=32"],
            "ref": then("ref-a", "train.batch_size=16"),
            "zero3-then-np1": then("zero3", "train.batch_size=16"),
        },
    )
    two = _train_many(
        tmp_path,
        2,
        {
            "zero3-then-zero2": then("zero3", "train.batch_size=8", "train.zero=2"),
            "onefile-then-zero3": then("zero3-onefile", "train.batch_size=8", *ZERO3),
            "zero1-then-zero3": then("zero1", "train.batch_size=8", *ZERO3),
            "plain-then-zero3": then("ref-a", "train.batch_size=8", *ZERO3),
        },
    )
    ref = one["ref"][0]
    for name, (weights, _) in [*two.items(), ("zero3-then-np1", one["zero3-then-np1"])]:
        # the data position carried over: 5 x 32 samples done, the rest in steps of 16
        assert sorted(_step_losses(tmp_path / f"{name}.npz.run")) == list(range(6, 36)), name
        for k in ref:
            np.testing.assert_allclose(weights[k], ref[k], atol=1e-5, err_msg=f"{name}: {k}")


def test_zero_refuses_what_it_cannot_shard(tmp_path):
    from hpctrain.config import Config
    from hpctrain.errors import ConfigError

    for clash in ("train.allreduce=horovod", "train.compression=topk", "train.sync_every=4"):
        with pytest.raises(ConfigError, match="train.zero=1"):
            Config.load(None, ["train.zero=1", clash])


def test_tensorflow_zero3_resumes_bit_for_bit_and_in_torch(tmp_path):
    """TensorFlow's ZeRO-3 at np 2 (three units, Adam, 2 micro-batches, clipping): a run
    stopped at step 5 resumes from its sharded checkpoint, each rank's own parameter
    ranges, and ends bit for bit where the uninterrupted run ended, every step's loss
    identical; the same checkpoint continues in torch as one plain process and as
    ZeRO-3 at np 2, both equal to the TensorFlow run within the backends' 1e-5; and the
    reverse: a plain TensorFlow checkpoint (np 2, ZeRO-0) continues as ZeRO-3 within
    1e-6 of the ZeRO-3 run."""
    job = [
        *ZERO3_JOB,
        *ZERO3,
        "backend=tensorflow",
        "train.batch_size=8",
        "train.grad_accum=2",
        "train.clip_norm=0.05",
        "train.max_steps=10",
    ]
    first = _train_many(
        tmp_path,
        2,
        {
            "ref": job,
            "part1": [*job, "train.max_steps=5"],
            "plain-part1": [*job, "train.max_steps=5", "train.zero=0"],
        },
    )
    ckpt = tmp_path / "part1.npz.run" / "checkpoints" / "ckpt-00000005.h5"
    ranges = _model_ranges(ckpt)
    assert len(ranges) == 2 and all(ranges.values()), ranges
    _assert_ranges_cover_once(ranges, [f"model/{k}" for k in first["ref"][0]])
    resume = f"checkpoint.resume={ckpt}"
    torch = ["backend=torch", "train.allreduce=mpi", resume]
    plain = tmp_path / "plain-part1.npz.run" / "checkpoints" / "ckpt-00000005.h5"
    again = _train_many(
        tmp_path,
        2,
        {
            "resumed": [*job, resume],
            "torch-zero3": [*job, *torch],
            "from-plain": [*job, f"checkpoint.resume={plain}"],
        },
    )
    one = _train_many(
        tmp_path, 1, {"torch-np1": [*job, *torch, "train.zero=0", "train.batch_size=16"]}
    )
    ref, ref_losses = first["ref"][0], _step_losses(tmp_path / "ref.npz.run")
    for k in ref:
        np.testing.assert_array_equal(again["resumed"][0][k], ref[k], err_msg=k)
    losses = _step_losses(tmp_path / "resumed.npz.run")
    assert sorted(losses) == list(range(6, 11))
    assert all(losses[s] == ref_losses[s] for s in losses)
    for name, (weights, _) in [
        ("torch-zero3", again["torch-zero3"]),
        ("torch-np1", one["torch-np1"]),
    ]:
        for k in ref:
            np.testing.assert_allclose(weights[k], ref[k], atol=1e-5, err_msg=f"{name}: {k}")
    _assert_same_weights(again["from-plain"][0], ref, 1e-6)
