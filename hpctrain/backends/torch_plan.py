"""What the memory plan needs of a torch zoo model, without allocating it: the model is
built on torch's meta device (shapes, no memory), its parameters counted per layer, and
one micro-batch run forward with a saved-tensors hook that adds up what autograd keeps
for backward (the activations; parameters excluded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..exchange.memory_plan import ModelShape, plan_stage
from ..models import zoo
from ..moe.parallel import is_expert_param, local_layers
from ..tensor import parallel as tensor_parallel
from .groups import ModelGroups
from .torch_model import ZooNet
from .torch_zero3 import module_params


def plan_shape(model_cfg: dict, inp: zoo.InputSpec, groups: ModelGroups, batch: int, seed=0):
    """The ModelShape of this rank's part of a zoo model (None for a user's model)."""
    if not zoo.is_zoo_model(model_cfg["name"]):
        return None
    layers = zoo.build_layers(model_cfg, inp)
    mine = tensor_parallel.local_layers(
        local_layers(layers, seed, groups.experts), groups.tensor.size
    )
    with torch.device("meta"):
        model = ZooNet(mine, groups)
    named = list(model.named_parameters())
    dense = [p for n, p in named if not is_expert_param(n)]
    experts = sum(p.numel() for n, p in named if is_expert_param(n))
    return ModelShape(
        sizes=[p.numel() for p in dense],
        layers=module_params(model, dense),  # ZeRO-3's grouping of them into units
        expert_elements=experts,
        # routing needs values, so a meta forward cannot run MoE layers: not counted
        activation_bytes=0 if zoo.has_moe(model_cfg) else _saved_bytes(model, inp, batch),
    )


def _saved_bytes(model, inp: zoo.InputSpec, batch: int) -> int:
    """Bytes autograd saves for backward in a forward of `batch` samples and the loss."""
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.device("meta"):
        if inp.tokens:
            x = torch.zeros((batch, *inp.shape), dtype=torch.long)
            y = torch.zeros((batch, *inp.shape), dtype=torch.long)
        else:
            x = torch.zeros((batch, *inp.shape))
            y = torch.zeros((batch,), dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x).float()
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return sum(seen.values())


def plan_stages(
    cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, stages, threads=1, rank=0, gpu=False
):
    """(ModelShape, {stage: the plan's terms}, this process's resident bytes before the
    model) for a zoo model on `n` data-parallel ranks, or None for a user's model.
    Prepares the process first (threads, seeds), as the backend will, so the baseline
    includes torch's thread pools."""
    from .torch_steps import prepare_process, resident_baseline

    t = cfg.train
    shape = plan_shape(cfg.model, inp, groups, t["batch_size"], t["seed"])
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
