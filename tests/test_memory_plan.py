"""The memory plan's arithmetic (exchange/memory_plan.py) against the ZeRO paper's
accounting, the model shapes the torch backend counts on fake tensors, and
`hpctrain plan-memory` (no launch). The plan against measured peaks:
test_memory_plan_jobs.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.exchange.memory_plan import STAGES, ModelShape, plan_stage, table

MIB = 1 << 20
ADAM = {"name": "adam", "weight_decay": 0.0}
SGD = {"name": "sgd", "momentum": 0.9, "weight_decay": 0.0}


def plan_all(shape, n, optimizer, unit_bytes, bucket_bytes) -> dict:
    return {s: plan_stage(shape, n, s, optimizer, unit_bytes, bucket_bytes) for s in STAGES}


def _shape(layers=8, per_layer=1 << 20):
    sizes = [per_layer] * layers
    return ModelShape(sizes=sizes, layers=[[i] for i in range(layers)], activation_bytes=0)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_model_state_per_stage_follows_the_zero_accounting(n):
    """float32 with Adam: optimizer state 8 Psi, then 8 Psi/N; ZeRO-3's parameters and
    gradients 4 Psi/N each beside two gathered units and one unit's gradient."""
    shape = _shape()
    psi = sum(shape.sizes)
    unit = 4 * (1 << 20)
    p = plan_all(shape, n, ADAM, unit_bytes=unit, bucket_bytes=unit)
    assert p[0]["optimizer"] == 8 * psi
    for stage in (1, 2, 3):
        assert p[stage]["optimizer"] == pytest.approx(8 * psi / n)
    assert p[0]["parameters"] == p[1]["parameters"] - 4 * psi / n == 4 * psi
    # plain data parallelism: param.grad, and the exchange's buffer where there are peers
    # (one process never writes it: found reading the GPU plan test, whose one process
    # would have measured 4 Psi fewer than planned)
    assert p[0]["gradients"] == (8 if n > 1 else 4) * psi
    assert p[3]["parameters"] == pytest.approx(4 * psi / n)
    assert p[3]["gathered"] == 2 * unit
    if n > 1:  # sharding pays off beyond one rank
        assert p[2]["gradients"] < p[1]["gradients"] < p[0]["gradients"]
        totals = [p[s]["total"] for s in (0, 2, 3)]
        assert totals == sorted(totals, reverse=True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_the_optimizer_state_and_its_master_to_the_host(stage):
    """train.offload=optimizer on a GPU rank: Adam's slots and their step's temporaries
    leave the GPU's terms; the host holds master, gradient copy and two slots, 16 Psi/N."""
    shape, n, unit = _shape(), 4, 4 * MIB
    psi = sum(shape.sizes)
    kept = plan_stage(shape, n, stage, ADAM, unit, unit, gpu=True)
    moved = plan_stage(shape, n, stage, ADAM, unit, unit, "optimizer", gpu=True)
    assert kept["offloaded"] == 0 and moved["optimizer"] == 0
    assert moved["offloaded"] == pytest.approx(16 * psi / n)
    assert kept["total"] - moved["total"] == pytest.approx(8 * psi / n)
    for term in ("parameters", "gathered", "gradients", "activations"):
        assert moved[term] == kept[term]
    plain = plan_stage(shape, n, 0, ADAM, unit, unit, "optimizer", gpu=True)
    assert plain["offloaded"] == 0  # not without ZeRO (the config refuses it)
    if stage == 3:  # optimizer+params: the shard leaves too, two staging pieces stay
        both = plan_stage(shape, n, 3, ADAM, unit, unit, "optimizer+params", gpu=True)
        assert both["offloaded"] == moved["offloaded"]
        assert both["parameters"] == pytest.approx(2 * unit / n)
        assert moved["total"] - both["total"] == pytest.approx(4 * psi / n - 2 * unit / n)


def test_a_gpu_rank_plans_no_exchange_scratch_and_no_fused_adam_temporaries():
    """NCCL's buffers and Gloo's host staging are outside the CUDA allocator, and Adam
    is fused on GPU ranks; SGD's weight decay still makes a temporary there."""
    shape, unit = _shape(), 4 * MIB
    for stage in STAGES:
        cpu = plan_stage(shape, 4, stage, ADAM, unit, unit)
        gpu = plan_stage(shape, 4, stage, ADAM, unit, unit, gpu=True)
        assert cpu["transients"] > 0 and gpu["transients"] == 0
    decay = {**SGD, "weight_decay": 0.1}
    gpu = plan_stage(shape, 4, 2, decay, unit, unit, gpu=True)
    assert gpu["transients"] == pytest.approx(4 * sum(shape.sizes) / 4)


def test_a_gpu_table_marks_the_gpu_peak_and_the_host_peak_apart():
    shape, unit = _shape(), 4 * MIB
    plans = {s: plan_stage(shape, 4, s, ADAM, unit, unit, "optimizer", True) for s in STAGES}
    gpu_limit = plans[2]["total"]  # ZeRO-2 fits exactly; plain and ZeRO-1 do not
    lines = table(plans, 300 * MIB, 310 * MIB, gpu=True, gpu_limit=gpu_limit).splitlines()
    assert " ".join(lines[0].split()[-6:]) == "GPU peak offloaded baseline host peak"
    assert "over the limit" in lines[1] and "over the limit" in lines[2]
    zero2 = lines[3]
    assert zero2.count("(fits)") == 1 and "over the limit" in zero2  # the host's 16 Psi/N
    assert lines[1].endswith("300 (fits)")  # nothing offloaded without ZeRO


def test_zero3_gathers_whole_layers_merged_up_to_the_unit_size():
    shape = _shape(layers=6, per_layer=1000)
    one = plan_stage(shape, 2, 3, SGD, unit_bytes=1, bucket_bytes=1)
    assert one["gathered"] == 2 * 4 * 1000  # a layer per unit
    three = plan_stage(shape, 2, 3, SGD, unit_bytes=3 * 4000, bucket_bytes=1)
    assert three["gathered"] == 2 * 3 * 4 * 1000  # three layers per unit


def test_a_table_marks_what_fits_a_limit():
    plans = plan_all(_shape(), 4, ADAM, 4 * MIB, 4 * MIB)
    limit = 300 * MIB + plans[2]["total"]
    text = table(plans, 300 * MIB, limit)
    lines = text.splitlines()
    assert lines[0].split()[0] == "stage" and len(lines) == 5
    assert "over the limit" in lines[1] and "(fits)" in lines[3] and "(fits)" in lines[4]


def test_the_torch_backend_counts_parameters_per_layer_and_activations_on_fake_tensors():
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_model import build_model
    from hpctrain.backends.torch_plan import plan_shape
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec

    cfg = Config.load(None, ["model.name=transformer", "data.task=tokens"])
    inp = benchmark_input_spec(cfg.data)
    shape = plan_shape(cfg.model, inp, ModelGroups(), batch=8)
    model = build_model(cfg.model, inp, 0)
    assert shape.sizes == [p.numel() for p in model.parameters()]
    assert sorted(i for layer in shape.layers for i in layer) == list(range(len(shape.sizes)))
    # activations grow with the micro-batch linearly (beside one parameter's gradient,
    # the causal mask)
    half, twice = (plan_shape(cfg.model, inp, ModelGroups(), batch=b) for b in (4, 16))
    step = shape.activation_bytes - half.activation_bytes
    assert step > 0 and twice.activation_bytes - shape.activation_bytes == pytest.approx(
        2 * step, rel=0.01
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["cpu-attention", "gpu-attention"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "checkpointed"])
def test_the_plan_traces_on_fake_tensors_what_real_ones_take(precision, fused, recompute):
    """The plan's micro-batch on fake tensors (no memory) takes, byte for byte, what the
    same micro-batch takes on real tensors (the same counting, backends/torch_plan.py):
    bf16's dtypes and weight copies, a GPU rank's fused attention (no sequence x
    sequence scores), a checkpointed block's recomputation. On the meta device autocast
    did nothing: bf16 planned as float32."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_model import ZooNet
    from hpctrain.backends.torch_plan import _step_bytes, plan_shape
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.models import zoo

    sets = ["model.name=transformer", "data.task=tokens", "data.seq_len=64"]
    cfg = Config.load(None, [*sets, f"model.checkpoint_activations={recompute}"])
    inp = benchmark_input_spec(cfg.data)
    with FakeTensorMode():
        fake = ZooNet(zoo.build_layers(cfg.model, inp), fused_attention=fused)
        x = torch.zeros((4, *inp.shape), dtype=torch.long)
        traced = _step_bytes(fake, x, x, precision)
    model = ZooNet(zoo.build_layers(cfg.model, inp), fused_attention=fused)
    x = torch.zeros((4, *inp.shape), dtype=torch.long)
    assert traced == _step_bytes(model, x, x, precision)  # saved, held, peak
    assert traced.held <= traced.peak
    if fused:  # a GPU rank's plan: the live count's peak
        planned = plan_shape(cfg.model, inp, ModelGroups(), 4, precision=precision, gpu=True)
        assert planned.activation_bytes == traced.peak
    for gpu in (False, True):
        at = plan_shape(cfg.model, inp, ModelGroups(), 4, precision=precision, gpu=gpu)
        fp32 = plan_shape(cfg.model, inp, ModelGroups(), 4, gpu=gpu)
        assert (at.activation_bytes < fp32.activation_bytes) == (precision == "bf16")
    cpu = plan_shape(cfg.model, inp, ModelGroups(), 4, precision=precision)
    gpu = plan_shape(cfg.model, inp, ModelGroups(), 4, precision=precision, gpu=True)
    assert gpu.activation_bytes < cpu.activation_bytes  # no 4 x heads x 64 x 64 scores


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_steps_micro_batch_takes_what_the_plan_says(precision):
    """The training step's own micro-batch (backward_mean_loss on real tensors), counted
    op by op: its peak is the live count's (a GPU rank's activations term; here with
    the CPU attention), plus at most the gradients it keeps (the gradients term). A
    large vocabulary makes the logits count: the step held them and their float32 copy
    through backward (4 bytes per token and entry, 6 at bf16): 14 and 22 MiB above the
    live count and its gradients here."""
    import torch

    from hpctrain.backends.torch_model import ZooNet
    from hpctrain.backends.torch_plan import _LiveBytes, _step_bytes
    from hpctrain.backends.torch_steps import backward_mean_loss
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.models import zoo

    sets = ["model.name=transformer", "data.task=tokens", "data.seq_len=64", "data.vocab=8192",
            "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=1"]  # fmt: skip
    cfg = Config.load(None, sets)
    inp = benchmark_input_spec(cfg.data)
    model = ZooNet(zoo.build_layers(cfg.model, inp))
    x = np.zeros((8, *inp.shape), np.int64)
    planned = _step_bytes(model, torch.from_numpy(x), torch.from_numpy(x), precision).peak
    live = _LiveBytes([*model.parameters(), *model.buffers()])
    with live:
        backward_mean_loss(model, [(x, x)], bf16=precision)
    grads = sum(4 * p.numel() for p in model.parameters())
    assert planned <= live.peak <= planned + grads, (live.peak, planned, grads)


def test_plan_memory_prints_every_stage_without_launching(capsys):
    from hpctrain.cli import main

    code = main(["plan-memory", "--np", "4", "--set", "model.name=transformer",
                 "--set", "data.task=tokens", "--limit-mb", "100000"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "4 rank(s) = 4 data-parallel x 1 tensor" in out
    rows = [line.split()[0] for line in out.splitlines()[1:6]]
    assert rows == ["stage", "plain", "ZeRO-1", "ZeRO-2", "ZeRO-3"], out
    assert out.count("(fits)") == 4


def test_plan_memory_refuses_what_it_cannot_plan():
    from hpctrain.config import Config
    from hpctrain.errors import ConfigError
    from hpctrain.memory_report import plan_memory

    with pytest.raises(ConfigError, match="multiple of parallel.tensor=2"):
        plan_memory(Config.load(None, ["model.name=transformer", "data.task=tokens",
                                       "parallel.tensor=2"]), 3, None)  # fmt: skip
    with pytest.raises(ConfigError, match="torch backend's data-parallel strategy"):
        plan_memory(Config.load(None, ["backend=tensorflow"]), 2, None)
    with pytest.raises(ConfigError, match="world size 3 is not divisible by pipeline.stages=2"):
        plan_memory(Config.load(None, ["strategy=pipeline", "pipeline.stages=2"]), 3, None)


# --- a pipeline stage's plan ----------------------------------------------------------------
PIPE_MODEL = ["model.name=transformer", "data.task=tokens", "model.n_layers=4",
              "model.d_model=512", "model.n_heads=8", "model.d_ff=2048",
              "strategy=pipeline", "pipeline.stages=2", "pipeline.microbatches=8", "optimizer.name=adam"]  # fmt: skip


def test_plan_memory_prints_a_row_per_pipeline_stage_and_the_schedule_sets_activations(capsys):
    """Each stage holds its own layers' state (the two halves of the model sum to the
    whole), and its activations are those of the micro-batches its schedule keeps:
    GPipe all m on every stage, 1F1B P - s (2 on stage 0, 1 on stage 1)."""
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.memory_report import plan_memory
    from hpctrain.models import zoo

    got = {}
    for schedule in ("gpipe", "1f1b"):
        out = plan_memory(Config.load(None, [*PIPE_MODEL, f"pipeline.schedule={schedule}"]), 2, 1e5)
        rows = [
            line.strip()
            for line in out.splitlines()
            if line.strip().startswith("stage ") and "(layers" in line
        ]
        assert len(rows) == 2 and out.count("(fits)") == 2, out
        got[schedule] = [[float(c.replace(",", "")) for c in r.split(")", 1)[1].split()[:6]]
                         for r in rows]  # fmt: skip
    assert "holds 2 micro-batches" in out and "holds 1 micro-batch" in out, out  # 1F1B
    gpipe, f1b = got["gpipe"], got["1f1b"]
    for s in (0, 1):
        assert gpipe[s][:4] == f1b[s][:4]  # parameters .. optimizer: the schedule's not
    # (m - 1) micro-batches held beside one's forward and backward: GPipe 7 on each,
    # 1F1B 1 on stage 0 and none on stage 1 (test_a_pipeline_stage_plan_counts_...)
    assert gpipe[0][4] > 2 * f1b[0][4] and gpipe[1][4] > 3 * f1b[1][4]
    assert f1b[0][4] > f1b[1][4]
    cfg = Config.load(None, PIPE_MODEL)
    psi = sum(
        lay.param_count() for lay in zoo.build_layers(cfg.model, benchmark_input_spec(cfg.data))
    )
    assert (f1b[0][0] + f1b[1][0]) * MIB == pytest.approx(4 * psi, rel=0.01)  # MiB, rounded


def test_a_pipeline_stage_plan_counts_what_the_stage_holds():
    """One replica per stage, Adam: parameters 4 Psi_s, gradients 4 Psi_s plus the largest
    parameter's new gradient (accumulated over micro-batches), optimizer 8 Psi_s; the
    stage's activations per micro-batch include its input (a leaf that needs a gradient)
    and, before the last stage, its output."""
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch_plan import plan_pipeline_stage
    from hpctrain.config import Config
    from hpctrain.data import benchmark_input_spec
    from hpctrain.models import zoo

    cfg = Config.load(None, PIPE_MODEL)
    inp = benchmark_input_spec(cfg.data)
    layers = zoo.build_layers(cfg.model, inp)
    middle = [i for i, lay in enumerate(layers) if lay.kind == "block"][1:3]  # two blocks
    start, stop = middle[0], middle[-1] + 1
    sizes = [int(np.prod(s)) for lay in layers[start:stop] for s in lay.params.values()]
    psi = sum(sizes)
    one, two, three = (
        plan_pipeline_stage(cfg, inp, layers, start, layers[start:stop], ModelGroups(), 1, k)[0]
        for k in (1, 2, 3)
    )
    assert one["parameters"] == 4 * psi
    assert one["gradients"] == 4 * psi + 4 * max(sizes)
    assert one["optimizer"] == 8 * psi
    # each micro-batch more in flight holds its forward's set beside one's whole step
    held = two["activations"] - one["activations"]
    assert three["activations"] - two["activations"] == held <= one["activations"]
    b, d = cfg.train["batch_size"], cfg.model["d_model"]
    edge = 4 * b * cfg.data["seq_len"] * d  # the stage's input, and its output, float32
    assert held > 2 * edge


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "abc"])
def test_plan_memory_refuses_a_limit_that_is_not_a_positive_number(value, capsys):
    """--limit-mb 0, -5 or nan was accepted (nan then read "over the limit")."""
    from hpctrain.cli import main

    for option in ("--limit-mb", "--gpu-mb"):
        with pytest.raises(SystemExit) as end:
            main(["plan-memory", "--np", "1", option, value])
        assert end.value.code == 2
        assert f"argument {option}: expected" in capsys.readouterr().err


def test_plan_memory_plans_the_model_for_the_data_file_it_will_train_on(tmp_path, capsys):
    """data.source=hdf5: the model's input and classes are the file's (64 features, 100
    classes here), not the synthetic task's (plan-memory ignored data.path); a missing
    file is the run's one line."""
    from hpctrain.cli import main
    from hpctrain.data.synthetic import generate, write_dataset

    path = tmp_path / "d.h5"
    splits, attrs = generate("vectors", 256, 64, seed=0, classes=100, features=64)
    write_dataset(path, splits, attrs)
    given = ["--set", "data.source=hdf5", "--set", f"data.path={path}"]
    assert main(["plan-memory", "--np", "1", *given]) == 0
    psi = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 100 + 100  # the mlp's [128, 128]
    assert f"{psi:,} dense parameters" in capsys.readouterr().out
    assert main(["plan-memory", "--np", "1", "--set", "data.source=hdf5",
                 "--set", f"data.path={tmp_path}/none.h5"]) == 2  # fmt: skip
    assert "dataset file not found" in capsys.readouterr().err
