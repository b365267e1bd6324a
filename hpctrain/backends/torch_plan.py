"""What the memory plan needs of a torch zoo model, without allocating it: the model is
built of torch's fake tensors (shapes and dtypes, no memory), its parameters counted per
layer, and one micro-batch run forward with a saved-tensors hook that adds up what
autograd keeps for backward (the activations; parameters excluded). With activation
checkpointing the hook sees only each block's input; backward then recomputes one block
at a time, whose whole saved set is alive beside its gradients: `_recompute_bytes` adds
that.

Fake tensors rather than the meta device: they are CPU tensors to torch's dispatcher, so
`train.precision` bf16/fp16 runs the forward under torch's own autocast, as the step
does, and what the hook sees has the step's dtypes: half-size activations, and the
half-precision copies of the weights the matmuls save (autocast's cast cache, alive
until backward). On the meta device autocast does nothing: a bf16 plan counted float32
activations and no weight copies (measured, 50 M transformer, one process: plan
1,107 MiB against a peak of 1,239, 11% low). A GPU rank's plan runs the attention its
step runs there (torch's fused kernel, which keeps no sequence x sequence scores: the
CPU step's explicit softmax does). The one difference left on a GPU rank: the dtypes
follow CPU autocast's op lists (CUDA's keeps layer norms in float32; CPU's runs them in
bf16): a few bytes per token and channel per layer norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ..exchange.memory_plan import ModelShape, plan_stage
from ..models import zoo
from ..moe.parallel import is_expert_param, local_layers
from ..tensor import parallel as tensor_parallel
from .groups import ModelGroups
from .torch_model import ZooNet
from .torch_steps import compute_precision, prepare_process, resident_baseline
from .torch_zero3 import module_params


def plan_shape(
    model_cfg: dict, inp: zoo.InputSpec, groups: ModelGroups, batch: int, seed=0,
    precision: str = "fp32", gpu: bool = False,
):  # fmt: skip
    """The ModelShape of this rank's part of a zoo model (None for a user's model), its
    activations those of a `precision` step on a GPU rank (`gpu`) or a CPU one."""
    if not zoo.is_zoo_model(model_cfg["name"]):
        return None
    layers = zoo.build_layers(model_cfg, inp)
    mine = tensor_parallel.local_layers(
        local_layers(layers, seed, groups.experts), groups.tensor.size
    )
    with FakeTensorMode():
        model = ZooNet(mine, groups, fused_attention=gpu)
        named = list(model.named_parameters())
        dense = [p for n, p in named if not is_expert_param(n)]
        # routing needs values, so a fake forward cannot run MoE layers: not counted
        saved = 0 if zoo.has_moe(model_cfg) else _saved_bytes(model, inp, batch, precision)
    return ModelShape(
        sizes=[p.numel() for p in dense],
        layers=module_params(model, dense),  # ZeRO-3's grouping of them into units
        expert_elements=sum(p.numel() for n, p in named if is_expert_param(n)),
        activation_bytes=saved,
    )


def _recompute_bytes(model, x, precision: str) -> int:
    """Activation checkpointing's backward: one block recomputed at a time, its saved
    set alive with the gradients flowing through it and the backward's temporaries, each
    about as many bytes: three times the largest checkpointed block's saved bytes (0
    without checkpointing). Measured against the peak RSS (tests/test_memory_plan_jobs.py):
    twice left the plan 11-17% low on a 4-block transformer at micro-batch 8 and 16.
    Called inside the plan's FakeTensorMode."""
    worst = 0
    for layer in model.seq:
        if layer.spec.attrs.get("recompute"):
            here = x.detach().requires_grad_(True)
            worst = max(worst, _forward_bytes(layer, here, precision=precision))
        with torch.no_grad(), compute_precision(precision):
            x = layer(x)
    return 3 * worst


def _fake_batch(inp: zoo.InputSpec, batch: int):
    """(x, y) of `batch` samples, made inside the plan's FakeTensorMode (no memory)."""
    if inp.tokens:
        x = torch.zeros((batch, *inp.shape), dtype=torch.long)
        return x, torch.zeros_like(x)
    x = torch.zeros((batch, *inp.shape))
    return x, torch.zeros((batch,), dtype=torch.long)


def _saved_bytes(model, inp: zoo.InputSpec, batch: int, precision: str) -> int:
    """Bytes autograd saves for backward in a forward of `batch` samples and the loss,
    and what checkpointed blocks hold while backward recomputes them."""
    x, y = _fake_batch(inp, batch)
    return _forward_bytes(model, x, y, precision) + _recompute_bytes(model, x, precision)


def _forward_bytes(model, x, y=None, precision: str = "fp32") -> int:
    """Bytes a forward of `x` (fake tensors) keeps for backward: what autograd saves
    (and the loss on `y` saves: a whole model's or a last stage's), and, for a
    pipeline stage that is not the last (`y` None), its output, held until the next
    stage's gradient comes back; a stage's input that requires grad is held too. The
    forward under `precision`'s autocast and the loss in float32, as the step."""
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t):
        seen[id(t)] = t.numel() * t.element_size()

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            keep(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with compute_precision(precision):
            out = model(x)
        out = out.float()
        if y is None:
            keep(out)
        else:
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if x.requires_grad:
        keep(x)
    return sum(seen.values())


def plan_pipeline_stage(
    cfg, inp: zoo.InputSpec, model_layers, start: int, local, groups: ModelGroups,
    replicas: int, in_flight: int, threads=1, rank=0, gpu=False,
):  # fmt: skip
    """(the plan's terms, the baseline) of a rank of a pipeline stage before the stage
    exists, or None (a user's model; experts, whose routing a fake forward cannot run).

    The stage's layers (`local`: its part of model_layers[start:...], experts and
    tensor-parallel pieces its own) are a model trained over `replicas` at the
    configured ZeRO stage (0 or 1), exchange/memory_plan.plan_stage's terms; its
    activations are those of the `in_flight` micro-batches the schedule holds at once
    (schedule.peak_in_flight: GPipe m, 1F1B at most P - s), each with the stage's input
    and output; its gradients, accumulated over the micro-batches, add the largest
    parameter's (autograd's new gradient, before it is added to `.grad`). The input's
    shape comes from a fake forward of the layers before it."""
    model_cfg, t = cfg.model, cfg.train
    if not zoo.is_zoo_model(model_cfg["name"]) or zoo.has_moe(model_cfg):
        return None
    precision, last = t["precision"], start + len(local) == len(model_layers)
    with FakeTensorMode():
        x, y = _fake_batch(inp, t["batch_size"])
        if start:  # activations are whole between stages, on every tensor rank
            with torch.no_grad(), compute_precision(precision):
                x = ZooNet(model_layers[:start], fused_attention=gpu)(x).float()
            x.requires_grad_(True)
        net = ZooNet(local, groups, fused_attention=gpu)
        dense = list(net.parameters())
        held = _forward_bytes(net, x, y if last else None, precision)
        shape = ModelShape(
            sizes=[p.numel() for p in dense],
            layers=module_params(net, dense),
            activation_bytes=in_flight * held + _recompute_bytes(net, x, precision),
        )
    prepare_process(threads, t["deterministic"], t["seed"] + rank)
    unit, bucket = int(t["zero_unit_mb"] * 2**20), int(t["bucket_mb"] * 2**20)
    terms = plan_stage(shape, replicas, t["zero"], cfg.optimizer, unit, bucket, "none", gpu)
    if cfg.pipeline["microbatches"] > 1:  # each later micro-batch's gradient, then added
        accumulating = 4.0 * max(shape.sizes, default=0)
        terms["gradients"] += accumulating
        terms["total"] += accumulating
    return terms, resident_baseline(cfg.optimizer)


def plan_stages(
    cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, stages, threads=1, rank=0, gpu=False
):
    """(ModelShape, {stage: the plan's terms}, this process's resident bytes before the
    model) for a zoo model on `n` data-parallel ranks, or None for a user's model.
    Prepares the process first (threads, seeds), as the backend will, so the baseline
    includes torch's thread pools."""
    t = cfg.train
    shape = plan_shape(cfg.model, inp, groups, t["batch_size"], t["seed"], t["precision"], gpu)
    if shape is None:
        return None
    prepare_process(threads, t["deterministic"], t["seed"] + rank)
    unit, bucket = int(t["zero_unit_mb"] * 2**20), int(t["bucket_mb"] * 2**20)
    plans = {
        s: plan_stage(shape, n, s, cfg.optimizer, unit, bucket, t["offload"], gpu) for s in stages
    }
    return shape, plans, resident_baseline(cfg.optimizer)


def plan_before_build(
    cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, threads: int, rank, gpu=False
):
    """(the plan's terms for the configured ZeRO stage, the baseline) or None for a
    user's model: what the limit check needs before anything of the model exists."""
    planned = plan_stages(cfg, inp, groups, n, (cfg.train["zero"],), threads, rank, gpu)
    if planned is None:
        return None
    _, plans, baseline = planned
    return plans[cfg.train["zero"]], baseline
