"""Pipeline parallelism: the schedules and partitioner alone, then real mpirun jobs showing
that P stages x D replicas compute exactly what single-process training computes."""

import json

import numpy as np
import pytest
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun

from hpctrain.models import zoo
from hpctrain.pipeline.partition import balanced_counts, check_partition, stage_bounds
from hpctrain.pipeline.schedule import bubble_theory, peak_in_flight, stage_actions

SCRIPT = str(ROOT / "tests" / "scripts" / "pipeline_dump.py")
# A CNN, so stage boundaries fall after convolutions (TensorFlow's NHWC inside a stage).
MODEL = [
    "model.name=cnn",
    "model.channels=[4,8,8]",
    "data.task=images",
    "data.image_size=8",
    "data.train_samples=256",
    "data.val_samples=64",
    "optimizer.lr_scaling=none",
    "metrics.tensorboard=false",
    "data.prefetch=1",
]
ONE_SGD_STEP = ["train.max_steps=1", "optimizer.momentum=0", "optimizer.lr=0.2"]
# Global batch 32 everywhere: single process 32; pipelines 8 x 4 (D=1) and 4 x 4 x 2 (D=2).
PIPE = ["strategy=pipeline", "train.batch_size=4", "pipeline.microbatches=8"]


# --- framework-free pieces ---------------------------------------------------------------
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 8), (4, 3), (4, 8), (3, 16)])
def test_schedules_run_every_micro_batch_once_and_1f1b_bounds_memory(stages, micro):
    for s in range(stages):
        for name in ("gpipe", "1f1b"):
            acts = stage_actions(name, s, stages, micro)
            assert sorted(i for k, i in acts if k == "F") == list(range(micro))
            assert [i for k, i in acts if k == "B"] == list(range(micro))  # same order everywhere
            for k, i in acts:  # a backward never precedes its forward
                if k == "B":
                    assert acts.index(("F", i)) < acts.index(("B", i))
        assert peak_in_flight(stage_actions("gpipe", s, stages, micro)) == micro
        assert peak_in_flight(stage_actions("1f1b", s, stages, micro)) == min(stages - s, micro)
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)


def test_partition_balances_costs_and_covers_every_layer_once():
    assert balanced_counts([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_counts([10, 1, 1, 1, 1, 10], 3) == [1, 4, 1]
    assert balanced_counts([0, 5, 5, 0, 1], 2) == [2, 3]
    assert balanced_counts([3, 3, 3], 3) == [1, 1, 1]
    layers = zoo.build_layers({"name": "resnet", "depth": 20}, zoo.InputSpec((3, 8, 8), 10))
    counts = balanced_counts([lay.param_count() for lay in layers], 4)
    bounds = stage_bounds(counts)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(layers) and min(counts) >= 1
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    cost = [sum(lay.param_count() for lay in layers[a:b]) for a, b in bounds]
    assert max(cost) < 0.5 * sum(cost)  # balanced, not one heavy stage


def test_partition_problems_are_named():
    assert "more than the model's 3 layers" in check_partition("parameters", 3, 4)
    assert "sums to 4 layers but the model has 5" in check_partition([2, 2], 5, 2)
    assert "2 entries for pipeline.stages=3" in check_partition([2, 3], 5, 3)
    assert "at least one layer" in check_partition([0, 5], 5, 2)
    assert "not one of" in check_partition("flops", 5, 2)
    assert check_partition([2, 3], 5, 2) is None and check_partition("time", 5, 2) is None


# --- real mpirun jobs ------------------------------------------------------------------------
def _runs(out, np_, runs, timeout):
    args = [SCRIPT, str(out)] + [f"{name}:" + ";".join(o) for name, o in runs]
    job = mpirun(np_, PYTHON, *args, timeout=timeout)
    assert job.returncode == 0, job.output
    summaries = {}
    for line in job.output.splitlines():
        if line.startswith("SUMMARY "):
            _, name, text = line.split(" ", 2)
            summaries[name] = json.loads(text)
    result = {}
    for name, _ in runs:
        with np.load(out / f"{name}.npz") as f:
            result[name] = ({k: f[k] for k in f.files}, summaries[name])
    return result


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def runs(request, tmp_path_factory):
    """All the jobs of one backend: a single-process reference, np=2 and np=4 pipelines."""
    backend = request.param
    out = tmp_path_factory.mktemp(f"pipe-{backend}")
    common = [*MODEL, f"backend={backend}"]
    res = _runs(
        out,
        1,
        [
            ("ref1", [*common, "train.batch_size=32", *ONE_SGD_STEP]),
            ("ref3", [*common, "train.batch_size=32", "train.max_steps=3"]),  # momentum 0.9
        ],
        240,
    )
    pipe = [*common, *PIPE, *ONE_SGD_STEP]
    res |= _runs(
        out,
        2,
        [
            ("P2-gpipe", [*pipe, "pipeline.schedule=gpipe", "pipeline.partition=[2,3]"]),
            ("P2-1f1b", [*pipe, "pipeline.schedule=1f1b"]),
        ],
        240,
    )
    res |= _runs(
        out,
        4,
        [
            ("P4-gpipe", [*pipe, "pipeline.stages=4", "pipeline.schedule=gpipe"]),
            ("P4-1f1b", [*pipe, "pipeline.stages=4", "pipeline.schedule=1f1b"]),
            # Last: Horovod (process sets per stage) is initialised once per process.
            (
                "P2xD2",
                [*common, "strategy=pipeline", "train.batch_size=4", "pipeline.microbatches=4"]
                + ["train.max_steps=3", "pipeline.partition=time"],
            ),
        ],
        360,
    )
    return res


def _max_diff(a, b):
    assert a.keys() == b.keys()  # canonical names: a pipeline checkpoint is a DP checkpoint
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.parametrize("name", ["P2-gpipe", "P2-1f1b", "P4-gpipe", "P4-1f1b"])
def test_one_pipelined_sgd_step_equals_the_full_batch_gradient_step(runs, name):
    ref, ref_summary = runs["ref1"]
    got, summary = runs[name]
    init = zoo.init_weights(
        zoo.build_layers({"name": "cnn", "channels": [4, 8, 8]}, zoo.InputSpec((3, 8, 8), 10)), 0
    )
    assert _max_diff(dict(init), ref) > 1e-3  # the step moved the weights
    # plain SGD, momentum 0: w1 = w0 - lr * g, so equal weights (1e-5 / lr) = equal gradients
    assert _max_diff(got, ref) < 1e-5
    assert summary["loss"] == pytest.approx(ref_summary["loss"], abs=1e-5)
    assert summary["stages"] == int(name[1]) and summary["replicas"] == 1


def test_two_stages_by_two_replicas_equal_single_process_training_after_k_steps(runs):
    got, summary = runs["P2xD2"]
    ref, ref_summary = runs["ref3"]
    assert summary["stages"] == 2 and summary["replicas"] == 2 and summary["steps"] == 3
    assert _max_diff(got, ref) < 1e-5
    assert summary["val_accuracy"] == pytest.approx(ref_summary["val_accuracy"], abs=1e-6)
    assert summary["val_samples"] == 64  # every validation sample once, over replicas


def test_1f1b_holds_at_most_p_micro_batches_gpipe_m_and_each_stages_peak_memory_is_said(runs):
    assert runs["P4-1f1b"][1]["stage_peak_microbatches"] == [4, 3, 2, 1]  # m = 8 > P = 4
    assert runs["P4-gpipe"][1]["stage_peak_microbatches"] == [8, 8, 8, 8]
    assert runs["P2-1f1b"][1]["stage_peak_microbatches"] == [2, 1]
    assert runs["P2-gpipe"][1]["stage_peak_microbatches"] == [8, 8]
    s = runs["P4-1f1b"][1]
    assert len(s["stage_busy_sec"]) == len(s["stage_idle_sec"]) == 4
    assert s["stage_peak_memory_of"] == "peak RSS" and len(s["stage_peak_memory_mib"]) == 4
    assert all(100 < mib < 4096 for mib in s["stage_peak_memory_mib"])  # a framework process
    assert s["bubble_theory"] == pytest.approx(3 / 11)
    # each stage's memory plan beside its peak: torch's zoo stages are planned before
    # they are built (the limit check's plan); TensorFlow's are not
    plans = s["stage_plan_memory_mib"]
    if s["backend"] == "torch":
        assert all(100 < mib < 4096 for mib in plans), plans
    else:
        assert plans == [None] * 4


def test_the_pipeline_over_gloo_process_groups_equals_it_over_mpi(tmp_path):
    """train.allreduce=gloo (torch): activations and gradients between stages travel as
    tensors over the pipe axis's process group, each stage's gradients average over its
    replicas' group; the weights, losses and validation equal the MPI engine's runs
    within 1e-6 (one SGD step at 2 and 4 stages, 3 momentum steps at 2 stages x 2
    replicas, GPipe and 1F1B), and the one-step runs equal one process's step."""
    common = [*MODEL, "backend=torch"]
    pipe = [*common, *PIPE, *ONE_SGD_STEP]
    replicated = [*common, "strategy=pipeline", "train.batch_size=4", "pipeline.microbatches=4"]
    layouts = {
        2: {"P2-1f1b": [*pipe, "pipeline.schedule=1f1b"]},
        4: {
            "P4-gpipe": [*pipe, "pipeline.stages=4", "pipeline.schedule=gpipe"],
            "P2xD2-1f1b": [*replicated, "train.max_steps=3", "pipeline.schedule=1f1b"],
        },
    }
    got = _runs(tmp_path, 1, [("ref1", [*common, "train.batch_size=32", *ONE_SGD_STEP])], 240)
    for np_, runs in layouts.items():
        jobs = [
            (f"{n}-{e}", [*o, f"train.allreduce={e}"])
            for n, o in runs.items()
            for e in ("mpi", "gloo")
        ]
        got |= _runs(tmp_path, np_, jobs, 300)
    for runs in layouts.values():
        for name in runs:
            (gloo, gs), (mpi, ms) = got[f"{name}-gloo"], got[f"{name}-mpi"]
            assert (gs["engine"], ms["engine"]) == ("gloo", "mpi")
            assert _max_diff(gloo, mpi) < 1e-6, name
            assert gs["loss"] == pytest.approx(ms["loss"], abs=1e-6)
            assert gs["val_accuracy"] == pytest.approx(ms["val_accuracy"], abs=1e-6)
            if name != "P2xD2-1f1b":  # one SGD step: the full batch's gradient step
                assert _max_diff(gloo, got["ref1"][0]) < 1e-5, name


BAD = [
    (2, ["pipeline.stages=3"], "world size 2 is not divisible by pipeline.stages=3"),
    (2, ["pipeline.microbatches=0"], "pipeline.microbatches: must be >= 1, got 0"),
    (
        2,
        ["parallel.tensor=2", "model.name=transformer", "data.task=tokens"],
        "world size 2 is not divisible by pipeline.stages=2 x parallel.tensor=2: launch a "
        "multiple of 4 ranks",
    ),
    (2, ["train.zero=2"], "train.zero=2: the pipeline shards with ZeRO-1 (optimizer state)"),
]


@pytest.mark.parametrize("np_,overrides,message", BAD)
def test_bad_pipeline_input_is_reported_on_every_rank(tmp_path, np_, overrides, message):
    args = [HPCTRAIN, "train", "--run-dir", str(tmp_path / "run")]
    for o in ["strategy=pipeline", "data.train_samples=256", *overrides]:
        args += ["--set", o]
    job = mpirun(np_, *args, timeout=120)
    assert job.returncode == 2, job.output
    # agreed on every rank, said once by rank 0 naming them all
    assert job.output.count(message) == 1, job.output
    assert f"rank(s) 0-{np_ - 1}: " in job.output, job.output


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_a_stage_that_will_not_fit_its_limit_is_refused_before_any_compute(tmp_path, backend):
    """Each rank checks its own stage: torch's zoo stages are planned before they are
    built, TensorFlow's once built (what they will still allocate); the refusal names
    the stage, with its figures, and the ways to shrink a stage."""
    args = [HPCTRAIN, "train", "--run-dir", str(tmp_path / "run")]
    for o in [f"backend={backend}", "strategy=pipeline", "data.train_samples=256",
              "runtime.memory_limit_mb=100"]:  # fmt: skip
        args += ["--set", o]
    job = mpirun(2, *args, timeout=120)
    assert job.returncode == 2, job.output
    out = job.output
    assert "rank(s) 0: stage 0 of 2 (layers 0-" in out, out
    assert "rank(s) 1: stage 1 of 2 (layers " in out, out
    assert out.count("against a limit of 100 MiB (runtime.memory_limit_mb)") == 2, out
    assert "more stages than pipeline.stages=2" in out and "Traceback" not in out, out
    assert "step 1 " not in out  # no compute


# --- checkpoints -----------------------------------------------------------------------------
# Global batch 16 both ways: pipeline 2 stages x (4 x 4 micro-batches); data parallel 2 x 8.
CKPT = [
    *MODEL,
    "optimizer.name=adam",
    "optimizer.lr=0.01",
    "train.epochs=1",  # 256 / 16 = 16 steps
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=null",
]
PIPE2 = ["strategy=pipeline", "pipeline.stages=2", "train.batch_size=4", "pipeline.microbatches=4"]


def _train(run, *overrides, resume=None):
    args = ["train", "--run-dir", str(run)] + (["--resume", resume] if resume else [])
    for o in [*CKPT, *overrides]:
        args += ["--set", o]
    job = mpirun(2, HPCTRAIN, *args, timeout=120)
    assert job.returncode == 0, job.output
    return job


def test_pipeline_checkpoints_resume_exactly_and_move_to_and_from_data_parallel(tmp_path):
    from hpctrain.checkpoint import list_checkpoints, load

    def final(run):
        return load(run / "checkpoints" / "ckpt-00000016.h5")

    ref, part, dp = tmp_path / "ref", tmp_path / "part", tmp_path / "dp"
    _train(ref, *PIPE2)
    _train(part, *PIPE2, "train.max_steps=6")
    assert [s for s, _ in list_checkpoints(part / "checkpoints")] == [4, 6]
    job = _train(part, *PIPE2, resume="auto")
    assert "resumed from" in job.output and "ckpt-00000006.h5" in job.output, job.output
    want, got = final(ref), final(part)
    assert got.state.keys() == want.state.keys()
    for k in want.state:  # same stages, same order of operations: bit for bit
        np.testing.assert_array_equal(got.state[k], want.state[k], err_msg=k)
    # A pipeline checkpoint continues as data-parallel training (2 ranks x batch 8)...
    job = _train(dp, "train.batch_size=8", resume=str(part / "checkpoints" / "ckpt-00000004.h5"))
    assert "resumed from" in job.output, job.output
    dp_final = final(dp)
    assert dp_final.model_weights().keys() == want.model_weights().keys()
    for k, v in want.model_weights().items():
        np.testing.assert_allclose(dp_final.model_weights()[k], v, rtol=0, atol=1e-5, err_msg=k)
    # ...and a data-parallel checkpoint continues as a pipeline.
    back = tmp_path / "back"
    job = _train(back, *PIPE2, resume=str(dp / "checkpoints" / "ckpt-00000008.h5"))
    assert "resumed from" in job.output, job.output
    for k, v in want.model_weights().items():
        np.testing.assert_allclose(final(back).model_weights()[k], v, rtol=0, atol=1e-5, err_msg=k)


def test_bf16_stages_equal_one_bf16_process(tmp_path):
    """train.precision=bf16 (torch): each stage autocasts its own layers and sends float32
    (an exact widening of bfloat16). So 2 stages x 8 micro-batches of 4, over MPI and over
    Gloo, take exactly the step of one bf16 process accumulating 8 micro-batches of 4;
    and that step differs from float32's by far more than from one batch of 32 (bf16
    really computed)."""
    common = [*MODEL, "backend=torch", *ONE_SGD_STEP]
    bf16 = [*common, "train.precision=bf16"]
    one = [
        ("accum-bf16", [*bf16, "train.batch_size=4", "train.grad_accum=8"]),
        ("ref-bf16", [*bf16, "train.batch_size=32"]),
        ("ref", [*common, "train.batch_size=32"]),
    ]
    got = _runs(tmp_path, 1, one, 240)
    pipes = [(f"P2-bf16-{e}", [*bf16, *PIPE, f"train.allreduce={e}"]) for e in ("mpi", "gloo")]
    got |= _runs(tmp_path, 2, pipes, 300)
    accum, ref, fp32 = got["accum-bf16"][0], got["ref-bf16"][0], got["ref"][0]
    for name, _ in pipes:
        weights, summary = got[name]
        assert _max_diff(weights, accum) < 1e-6, name
        assert summary["loss"] == pytest.approx(got["accum-bf16"][1]["loss"], abs=1e-6)
        assert all(v.dtype == np.float32 for v in weights.values())  # float32 master weights
    # measured: 4.9e-5 between bf16 micro-batches and one bf16 batch (products rounded
    # to bfloat16 per micro-batch), 1.5e-3 between bf16's step and float32's
    assert _max_diff(accum, ref) < 2e-4 < 5e-4 < _max_diff(fp32, ref)
