"""Tensor parallelism (`parallel.tensor`) under real mpirun: the Megatron-split
transformer trains to the weights of one process (forward allreduce after attention
and MLP, backward allreduce before them), alone and combined with data parallelism and
with pipeline stages (data x pipe x tensor); each rank holds ~1/T of the split layers;
checkpoints are canonical."""

import json
import re

import numpy as np
import pytest
from dump_runs import TINY_TRANSFORMER, train_many
from mpirun import ROOT
from shared_runs import SharedRuns

SCRIPT = str(ROOT / "tests" / "scripts" / "tp_train_dump.py")
TRANSFORMER = [
    *TINY_TRANSFORMER,
    "data.train_samples=1024",
    "data.val_samples=128",
    "train.log_every=1",
    "optimizer.lr_scaling=none",
    "metrics.tensorboard=false",
    "train.max_steps=6",
    "optimizer.name=sgd",
    "optimizer.lr=0.1",
    "optimizer.momentum=0.9",
    "train.clip_norm=0.5",
    "train.allreduce=mpi",
]


def _train_many(where, np_, runs: dict, timeout=300, run_dir=None, resume=None) -> dict:
    """{name: (weights, step losses, per-rank parameter counts)} of runs trained in one
    launch (dump_runs.py; tp_train_dump.py sets each run's own layer groups)."""
    results = train_many(
        SCRIPT, where, np_, runs, base=TRANSFORMER, timeout=timeout,
        said=lambda out: re.escape(f"TP DUMP {out} over") + COUNTS, keep=lambda x: x["loss"],
        run_dir=run_dir, resume=resume,
    )  # fmt: skip
    return {
        n: (w, losses, json.loads(m.group(1)), m.group(2)) for n, (w, losses, m) in results.items()
    }


COUNTS = r" \d+ rank\(s\): local parameters (\[[0-9, ]+\]), tensor sums by (\w+)"


def _run(tmp_path, name, np_, *overrides, run_dir=None, resume=None):
    runs = {name: list(overrides)}
    return _train_many(tmp_path, np_, runs, run_dir=run_dir, resume=resume)[name]


# The comparison runs, one launch per (ranks, backend) (shared_runs.py); the runs that
# resume from a checkpoint start their own processes.
_SHARED = SharedRuns(_train_many, "tp-np")
share, shared_run = _SHARED.share, _SHARED.get  # (weights, losses, counts, sums) of a run


PIPE_TP = ["strategy=pipeline", "pipeline.microbatches=2", "parallel.tensor=2"]
PIPE_ZERO = ["strategy=pipeline", "pipeline.microbatches=2", "train.zero=1"]
ZERO3 = ["train.zero=3", "train.zero_unit_mb=0.004"]
LAYOUTS = {  # id: (np, overrides); global batch 16 everywhere
    "tensor2": (2, ["parallel.tensor=2", "train.batch_size=16"]),
    "tensor4": (4, ["parallel.tensor=4", "train.batch_size=16"]),
    "data2-tensor2": (4, ["parallel.tensor=2", "train.batch_size=8"]),
    "zero2-data2-tensor2": (
        4,
        ["parallel.tensor=2", "train.batch_size=8", "train.zero=2", "train.bucket_mb=0.004"],
    ),
    "zero1-data4": (4, ["parallel.tensor=1", "train.batch_size=4", "train.zero=1"]),
    # ZeRO-3: every block its own unit, gathered ahead of use (and again for backward,
    # also inside activation checkpointing's recomputation)
    "zero3-data2": (2, ["parallel.tensor=1", "train.batch_size=8", *ZERO3]),
    "zero3-data2-recompute": (
        2,
        ["parallel.tensor=1", "train.batch_size=8", *ZERO3, "model.checkpoint_activations=true"],
    ),
    "zero3-data2-tensor2": (4, ["parallel.tensor=2", "train.batch_size=8", *ZERO3]),
    # Pipeline stages of tensor-parallel blocks: 2 micro-batches x 8, and x 4 x 2 replicas.
    "pipe2-tensor2": (4, [*PIPE_TP, "train.batch_size=8"]),
    "data2-pipe2-tensor2": (8, [*PIPE_TP, "train.batch_size=4", "pipeline.schedule=gpipe"]),
    # ZeRO-1 over each stage's replicas, with and without tensor parallelism
    "zero1-data2-pipe2": (4, [*PIPE_ZERO, "parallel.tensor=1", "train.batch_size=4"]),
    "zero1-data2-pipe2-tensor2": (8, [*PIPE_ZERO, "parallel.tensor=2", "train.batch_size=4"]),
}


# TensorFlow's layouts that its canonical-checkpoint cases below also train (3 steps in
# the layout, then ending equal to one process) run here only in `make test-extended`.
TF_EXTENDED = {"zero2-data2-tensor2", "pipe2-tensor2", "zero1-data2-pipe2"}
BACKEND_LAYOUTS = [("torch", k) for k in LAYOUTS] + [
    ("tensorflow", k)
    for k in (
        "tensor2",
        "zero2-data2-tensor2",
        "zero3-data2-tensor2",
        "zero3-data2-recompute",  # a block's recompute_grad must reach ZeRO-3's tensors
        "pipe2-tensor2",
        "zero1-data2-pipe2",
    )
]
for _b in ("torch", "tensorflow"):
    share(1, _b, "ref", "train.batch_size=16")


def _extended(backend: str, layout: str) -> bool:
    return backend == "tensorflow" and layout in TF_EXTENDED


for _b, _layout in BACKEND_LAYOUTS:
    share(LAYOUTS[_layout][0], _b, _layout, *LAYOUTS[_layout][1], extended=_extended(_b, _layout))


@pytest.mark.parametrize(
    "backend, layout",
    [
        pytest.param(b, k, marks=[pytest.mark.extended] if _extended(b, k) else [])
        for b, k in BACKEND_LAYOUTS
    ],
)
def test_tensor_parallel_equals_one_process(tmp_path_factory, backend, layout):
    np_, overrides = LAYOUTS[layout]
    ref, ref_losses, ref_counts, _ = shared_run(tmp_path_factory, 1, backend, "ref")
    got, losses, counts, _ = shared_run(tmp_path_factory, np_, backend, layout)
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4)
    tensor = int(next(o for o in overrides if o.startswith("parallel.tensor")).split("=")[1])
    if "train.zero=3" in overrides:  # whole parameters exist only while a unit runs
        return
    split = sum(v.size for k, v in ref.items() if ".attn." in k or ".ffn." in k)
    split -= sum(v.size for k, v in ref.items() if k.endswith(("proj.bias", "fc2.bias")))
    if "strategy=pipeline" not in overrides:
        assert counts[0] == pytest.approx(ref_counts[0] - split + split / tensor, rel=1e-6)
        return
    # One replica's P x T ranks hold the model once: the split layers in T slices, the
    # rest on each of a stage's T ranks; a stage's tensor ranks hold equal shares.
    replica = counts[: 2 * tensor]
    assert sum(replica) == tensor * (ref_counts[0] - split) + split
    assert all(len(set(replica[s * tensor : (s + 1) * tensor])) == 1 for s in range(2))
    assert counts == replica * (np_ // len(replica))


# The process-group engine (torch.distributed over Gloo: the code NCCL runs on GPU
# ranks): the f/g activation sums on the tensor axis's group, gradients and ZeRO's
# shard on the data replicas' group, equal to the MPI engine's run of the same layout.
GLOO = {
    layout: f"gloo-{layout}"
    for layout in (
        "tensor2",
        "data2-tensor2",
        "zero2-data2-tensor2",
        "zero1-data4",
        "pipe2-tensor2",
        "zero1-data2-pipe2",  # each stage's ZeRO-1 shard on its replicas' group
        "zero1-data2-pipe2-tensor2",  # ... and its clip's split mask on the device
    )
}
for _layout, _name in GLOO.items():
    share(LAYOUTS[_layout][0], "torch", _name, *LAYOUTS[_layout][1], "train.allreduce=gloo")


@pytest.mark.parametrize("layout", list(GLOO))
def test_tensor_parallelism_over_gloo_equals_the_mpi_engine(tmp_path_factory, layout):
    np_ = LAYOUTS[layout][0]
    mpi, mpi_losses, mpi_counts, mpi_sums = shared_run(tmp_path_factory, np_, "torch", layout)
    got, losses, counts, sums = shared_run(tmp_path_factory, np_, "torch", GLOO[layout])
    tensor = "parallel.tensor=1" not in LAYOUTS[layout][1]
    assert (mpi_sums, sums) == ("mpi", "gloo" if tensor else "mpi")  # activations' group
    assert counts == mpi_counts and mpi.keys() == got.keys()
    for k in mpi:
        np.testing.assert_allclose(got[k], mpi[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(losses, mpi_losses, rtol=0, atol=1e-6)


CASES = {  # name: (first np, first overrides, then np, then overrides)
    "tp-then-plain": (2, ["parallel.tensor=2"], 1, []),
    "plain-then-tp": (1, [], 2, ["parallel.tensor=2"]),
    "zero-tp-then-plain": (4, ["parallel.tensor=2", "train.zero=2", "train.batch_size=8"], 1, []),
    "zero3-tp-then-plain": (4, ["parallel.tensor=2", *ZERO3, "train.batch_size=8"], 1, []),
    # one file: rank 0 writes what the ZeRO-3 x tensor ranks gather for it
    "zero3-tp-one-file-then-plain": (
        4,
        ["parallel.tensor=2", *ZERO3, "train.batch_size=8", "checkpoint.sharded=false"],
        1,
        [],
    ),
    "plain-then-zero3": (1, [], 2, ["parallel.tensor=1", *ZERO3, "train.batch_size=8"]),
    "tp-data-then-tp": (4, ["parallel.tensor=2", "train.batch_size=8"], 2, ["parallel.tensor=2"]),
    "pipe-tp-then-plain": (4, [*PIPE_TP, "train.batch_size=8"], 1, []),
    "plain-then-pipe-tp": (1, [], 4, [*PIPE_TP, "train.batch_size=8"]),
    "zero-pipe-tp-then-plain": (8, [*PIPE_ZERO, "parallel.tensor=2", "train.batch_size=4"], 1, []),
    "zero-pipe-then-plain": (4, [*PIPE_ZERO, "train.batch_size=4"], 1, []),
}


def _files_with(checkpoints, text: str) -> list:
    """The step-3 checkpoint's shard files holding pieces whose name contains `text`."""
    import h5py

    with h5py.File(checkpoints / "ckpt-00000003.h5", "r") as f:
        table = json.loads(f["manifest"][()].tobytes())["shards"]
    return [r["file"] for r in table["files"] if any(text in n for n in r["pieces"])]


def _flat_ranges(checkpoints) -> dict:
    """{file: names of optimizer pieces that are a part of their tensor} of the step-3
    checkpoint: what ZeRO ranks write of the state they alone hold."""
    import h5py

    with h5py.File(checkpoints / "ckpt-00000003.h5", "r") as f:
        table = json.loads(f["manifest"][()].tobytes())["shards"]
    return {
        r["file"]: [
            n
            for n, p in r["pieces"].items()
            if n.startswith("optimizer/") and p[3] < int(np.prod(p[1]))
        ]
        for r in table["files"]
    }


def _tensor_slices(checkpoints) -> dict:
    """{file: {name: where} of its tensor-parallel pieces} of the step-3 sharded
    checkpoint (where: ["tensor", rank, T] or, a range of the slice, [..., first])."""
    import h5py

    with h5py.File(checkpoints / "ckpt-00000003.h5", "r") as f:
        table = json.loads(f["manifest"][()].tobytes())["shards"]
    return {
        r["file"]: {n: p[2] for n, p in r["pieces"].items() if isinstance(p[2], list)}
        for r in table["files"]
    }


@pytest.mark.parametrize(
    "backend, case",
    [("torch", c) for c in CASES]
    + [
        ("tensorflow", c)
        for c in ("zero-tp-then-plain", "pipe-tp-then-plain", "zero-pipe-then-plain")
    ],
)
def test_tensor_parallel_checkpoints_are_canonical(tmp_path, tmp_path_factory, backend, case):
    """A tensor-parallel run (np=2, tensor 2) stopped at step 3 resumes as one process,
    a one-process checkpoint resumes at tensor 2, and a ZeRO-2 x tensor 2 x data 2 run
    resumes as one process, and a pipeline of tensor-parallel stages (pipe 2 x tensor 2)
    resumes as one process and back: all end equal to one process."""
    import shutil

    common = [f"backend={backend}", "train.batch_size=16", "checkpoint.every_steps=3"]
    ref, _, _, _ = shared_run(tmp_path_factory, 1, backend, "ref")  # (checkpoints change none)
    first_np, first, then_np, then = CASES[case]
    part = tmp_path / "part1"
    _run(tmp_path, "a", first_np, *common, *first, "train.max_steps=3", run_dir=part)
    sharded = "checkpoint.sharded=false" not in first
    if "parallel.tensor=2" in first and sharded:  # each tensor rank wrote its slices
        slices = _tensor_slices(part / "checkpoints")
        assert sum(1 for names in slices.values() if names) == first_np, slices
        assert any("attn.qkv.weight" in n for names in slices.values() for n in names)
    if not sharded:  # one file: no rank wrote pieces of its own
        assert not list((part / "checkpoints").glob("*.shards")), "sharded=false wrote shards"
    if case == "zero-pipe-then-plain":  # every replica wrote its own optimizer ranges
        ranges = _flat_ranges(part / "checkpoints")
        assert sum(1 for names in ranges.values() if names) == first_np, ranges
    if case in ("zero-tp-then-plain", "zero-pipe-tp-then-plain", "zero3-tp-then-plain"):
        ranges = [{n for n, w in names.items() if len(w) == 4} for names in slices.values()]
        assert sum(1 for names in ranges if names) == first_np, slices
        assert any(
            n.startswith("optimizer/") and "attn.qkv.weight" in n for n in set().union(*ranges)
        )
    if case == "zero3-tp-then-plain":  # ZeRO-3: the parameters too, each rank its ranges
        assert any(n.startswith("model/") and "attn.qkv.weight" in n for n in set().union(*ranges))
    run = tmp_path / case
    shutil.copytree(part / "checkpoints", run / "checkpoints")
    shutil.copy(part / "config.yaml", run / "config.yaml")
    got, _, _, _ = _run(tmp_path, case, then_np, *common, *then, run_dir=run, resume="auto")
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=f"{case} {k}")


# Mixture of experts inside tensor-parallel blocks: attention split over the tensor
# axis, each tensor rank routing half of its group's samples to experts spread over the
# expert x tensor ranks. With nothing dropped and no balancing loss it is one process's
# math; with capacity dropping and the balancing loss (both per routing rank's batch)
# it is data-parallel MoE's with the same routing batches (np 4, batch 4 per rank).
MOE_EXACT = "model.moe={experts: 4, top_k: 2, drop_tokens: false, aux_loss: 0}"
MOE_DROPS = "model.moe={experts: 4, top_k: 2, capacity_factor: 1.0, min_capacity: 0}"


for _b in ("torch", "tensorflow"):
    share(1, _b, "ref-moe", MOE_EXACT, "train.batch_size=16")


ZERO2 = ["train.zero=2", "train.bucket_mb=0.004", "train.batch_size=8"]
PIPE_MOE = ["strategy=pipeline", "pipeline.microbatches=2", "train.batch_size=4"]


MOE_LAYOUTS = {  # id: (backend, np, overrides)
    "torch-tensor2": ("torch", 2, ["parallel.tensor=2", "train.batch_size=16"]),
    "torch-data2-tensor2": ("torch", 4, ["parallel.tensor=2", "train.batch_size=8"]),
    "tensorflow-tensor2": ("tensorflow", 2, ["parallel.tensor=2", "train.batch_size=16"]),
    # ZeRO shards the dense state; the experts, local to their ranks, step beside it
    "torch-zero1": ("torch", 2, ["train.zero=1", "train.batch_size=8"]),
    "torch-zero2": ("torch", 2, ZERO2),
    "tensorflow-zero2": ("tensorflow", 2, ZERO2),
    "torch-zero2-data2-tensor2": ("torch", 4, [*ZERO2, "parallel.tensor=2"]),
    "torch-zero3": ("torch", 2, [*ZERO3, "train.batch_size=8"]),
    "torch-zero3-data2-tensor2": ("torch", 4, [*ZERO3, "train.batch_size=8", "parallel.tensor=2"]),
    # torch.distributed over Gloo: ZeRO-3's gathers and the experts' all-to-alls on tensors
    "torch-gloo-zero3": ("torch", 2, [*ZERO3, "train.batch_size=8", "train.allreduce=gloo"]),
    # ... and over the expert x tensor ranks' group, the f/g sums over the tensor axis's
    "torch-gloo-data2-tensor2": (
        "torch",
        4,
        ["parallel.tensor=2", "train.batch_size=8", "train.allreduce=gloo"],
    ),
    # TensorFlow's ZeRO-3 runs each unit again in backward: the experts' all-to-alls too
    "tensorflow-zero3": ("tensorflow", 2, [*ZERO3, "train.batch_size=8"]),
    "tensorflow-zero3-data2-tensor2": (
        "tensorflow",
        4,
        [*ZERO3, "train.batch_size=8", "parallel.tensor=2"],
    ),
    # pipeline stages: each stage's experts over its replicas (x its tensor ranks)
    "torch-data2-pipe2": ("torch", 4, PIPE_MOE),
    "tensorflow-data2-pipe2": ("tensorflow", 4, PIPE_MOE),
    "torch-data2-pipe2-tensor2": ("torch", 8, [*PIPE_MOE, "parallel.tensor=2"]),
    # ... over Gloo: the stages' links, the experts' token rows and copies on groups
    "torch-gloo-data2-pipe2": ("torch", 4, [*PIPE_MOE, "train.allreduce=gloo"]),
    "torch-gloo-data2-pipe2-tensor2": (
        "torch",
        8,
        [*PIPE_MOE, "parallel.tensor=2", "train.allreduce=gloo"],
    ),
}
for _name, (_b, _np, _overrides) in MOE_LAYOUTS.items():
    share(_np, _b, f"moe-{_name}", MOE_EXACT, *_overrides)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_experts_with_tensor_parallelism_zero_or_pipeline_equal_one_process(
    tmp_path_factory, layout
):
    backend, np_, _ = MOE_LAYOUTS[layout]
    ref, ref_losses, _, _ = shared_run(tmp_path_factory, 1, backend, "ref-moe")
    got, losses, counts, _ = shared_run(tmp_path_factory, np_, backend, f"moe-{layout}")
    assert ref.keys() == got.keys() and sum(".moe.experts." in k for k in ref) == 2 * 4 * 4
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4)
    experts = sum(v.size for k, v in ref.items() if ".moe.experts." in k)
    assert all(c < sum(v.size for v in ref.values()) - experts + experts / np_ + 1 for c in counts)


# The experts' all-to-alls and copies' averages on process groups (torch.distributed
# over Gloo, the code NCCL runs on GPU ranks) beside tensor parallelism and inside
# pipeline stages: the MPI engine's run of the same layout within 1e-6 (and every step
# of the Gloo runs watched for host reads, the router's one read per layer aside).
MOE_OVER_GLOO = ("data2-tensor2", "data2-pipe2", "data2-pipe2-tensor2")


@pytest.mark.parametrize("layout", MOE_OVER_GLOO)
def test_experts_over_gloo_equal_the_mpi_engine(tmp_path_factory, layout):
    np_ = MOE_LAYOUTS[f"torch-{layout}"][1]
    mpi, mpi_losses, mpi_counts, _ = shared_run(
        tmp_path_factory, np_, "torch", f"moe-torch-{layout}"
    )
    got, losses, counts, _ = shared_run(tmp_path_factory, np_, "torch", f"moe-torch-gloo-{layout}")
    assert counts == mpi_counts and mpi.keys() == got.keys()
    for k in mpi:
        np.testing.assert_allclose(got[k], mpi[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(losses, mpi_losses, rtol=0, atol=1e-6)


PIPE2 = ["strategy=pipeline", "pipeline.microbatches=2"]
SAME_ROUTING = {  # id: (backend, data-parallel MoE np and overrides, composed np and ...)
    # each tensor rank routes 4 of its group's 8 samples, as a data-parallel rank of 4
    "torch-data2-tensor2": (
        "torch",
        (4, ["train.batch_size=4"]),
        (4, ["train.batch_size=8", "parallel.tensor=2"]),
    ),
    # each stage's MoE layers route every micro-batch of 4 over the stage's 2 replicas
    # (the balancing loss backpropagated in the stage that holds the layer), as 2
    # data-parallel ranks accumulating 2 micro-batches of 4 do
    "torch-data2-pipe2": (
        "torch",
        (2, ["train.batch_size=4", "train.grad_accum=2"]),
        (4, ["train.batch_size=4", *PIPE2]),
    ),
    "tensorflow-data2-pipe2": (
        "tensorflow",
        (2, ["train.batch_size=4", "train.grad_accum=2"]),
        (4, ["train.batch_size=4", *PIPE2]),
    ),
    # ZeRO-3 in TensorFlow: each unit's balancing loss backpropagated in its own tape,
    # the routing recomputed in backward with its forward's jitter noise, its drops
    # not counted twice
    "tensorflow-zero3": (
        "tensorflow",
        (2, ["train.batch_size=8", "model.moe.jitter=0.1"]),
        (2, ["train.batch_size=8", "model.moe.jitter=0.1", *ZERO3]),
    ),
}


for _case, (_b, (_dp_np, _dp), (_np, _overrides)) in SAME_ROUTING.items():
    share(_dp_np, _b, f"routing-dp-{_case}", MOE_DROPS, *_dp)
    share(_np, _b, f"routing-{_case}", MOE_DROPS, *_overrides)


@pytest.mark.parametrize("case", SAME_ROUTING)
def test_composed_experts_drop_and_balance_like_data_parallel_moe(tmp_path_factory, case):
    """With capacity dropping tokens and the balancing loss on (both per routing batch),
    experts in tensor-parallel blocks or in pipeline stages compute what data-parallel
    MoE computes on the same routing batches."""
    backend, (dp_np, _), (np_, _) = SAME_ROUTING[case]
    dp, dp_losses, _, _ = shared_run(tmp_path_factory, dp_np, backend, f"routing-dp-{case}")
    got, losses, _, _ = shared_run(tmp_path_factory, np_, backend, f"routing-{case}")
    for k in dp:
        np.testing.assert_allclose(got[k], dp[k], rtol=0, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(losses, dp_losses, atol=1e-5)
    drops = _moe_drop_rates(tmp_path_factory, dp_np, backend, f"routing-dp-{case}")
    assert min(drops) > 0.05, drops  # capacity really dropped tokens
    if case == "tensorflow-zero3":  # the recomputed routing is not counted again
        got = _moe_drop_rates(tmp_path_factory, np_, backend, f"routing-{case}")
        np.testing.assert_allclose(got, drops, rtol=1e-6)
    if "pipe2" in case:  # the stages' metrics, combined over the job, are data parallel's
        for key in ("moe_drop_rate", "moe_dropped", "moe_load", "moe_aux_loss"):
            want = _moe_metric(tmp_path_factory, dp_np, backend, f"routing-dp-{case}", key)
            got = _moe_metric(tmp_path_factory, np_, backend, f"routing-{case}", key)
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=key)


def _moe_metric(tmp_path_factory, np_, backend, name, key) -> list:
    run_dir = shared_run(tmp_path_factory, np_, backend, name, run_dir=True)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return [x[key] for x in steps if x["event"] == "step"]


def _moe_drop_rates(tmp_path_factory, np_, backend, name) -> list[float]:
    return _moe_metric(tmp_path_factory, np_, backend, name, "moe_drop_rate")


@pytest.mark.parametrize(
    "backend, np_, layout",
    [
        ("torch", 4, ["parallel.tensor=2", "train.batch_size=8"]),
        ("tensorflow", 2, ZERO2),
        ("torch", 4, PIPE_MOE),
        ("tensorflow", 2, [*ZERO3, "train.batch_size=8"]),
    ],
    ids=["torch-data2-tensor2", "tensorflow-zero2", "torch-data2-pipe2", "tensorflow-zero3"],
)
def test_moe_checkpoints_with_tensor_parallelism_or_zero_resume_as_one_process(
    tmp_path, tmp_path_factory, backend, np_, layout
):
    """data 2 x tensor 2 with experts on the 4 expert x tensor ranks, or ZeRO-2 or 3
    with the experts on 2 ranks, stopped at step 3 (sharded: each rank its experts, its
    tensor slices, its ZeRO ranges), resumes as one process."""
    import shutil

    ref, _, _, _ = shared_run(tmp_path_factory, 1, backend, "ref-moe")
    common = [f"backend={backend}", MOE_EXACT, "checkpoint.every_steps=3"]
    part = tmp_path / "part1"
    first = [*common, *layout, "train.max_steps=3"]
    _run(tmp_path, "a", np_, *first, run_dir=part)
    if "parallel.tensor=2" in layout:
        slices = _tensor_slices(part / "checkpoints")
        assert sum(1 for names in slices.values() if names) == 4, slices
    elif "train.zero=2" in layout:  # each rank its ZeRO ranges of the dense state
        ranges = _flat_ranges(part / "checkpoints")
        assert sum(1 for names in ranges.values() if names) == np_, ranges
    experts = _files_with(part / "checkpoints", ".moe.experts.")
    assert len(experts) == np_, experts  # every rank wrote its own experts
    run = tmp_path / "resumed"
    shutil.copytree(part / "checkpoints", run / "checkpoints")
    shutil.copy(part / "config.yaml", run / "config.yaml")
    got, _, _, _ = _run(
        tmp_path, "b", 1, *common, "train.batch_size=16", run_dir=run, resume="auto"
    )
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
