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
from .torch_zero3 import unit_modules


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
    dense = [(n, p) for n, p in named if not is_expert_param(n)]
    index = {id(p): i for i, (_, p) in enumerate(dense)}
    per_layer = [
        sorted(index[id(p)] for p in m.parameters() if id(p) in index) for m in unit_modules(model)
    ]
    experts = sum(p.numel() for n, p in named if is_expert_param(n))
    return ModelShape(
        sizes=[p.numel() for _, p in dense],
        layers=per_layer,
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


def plan_before_build(cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, threads: int, rank):
    """(the plan's terms for the configured ZeRO stage, this process's resident bytes
    before the model) or None for a user's model: what the limit check needs before
    anything of the model is allocated. Prepares the process first (threads, seeds), as
    the backend will, so the baseline includes torch's thread pools."""
    from .torch_steps import prepare_process, resident_baseline

    t = cfg.train
    shape = plan_shape(cfg.model, inp, groups, t["batch_size"], t["seed"])
    if shape is None:
        return None
    prepare_process(threads, t["deterministic"], t["seed"] + rank)
    terms = plan_stage(
        shape,
        n,
        t["zero"],
        cfg.optimizer,
        int(t["zero_unit_mb"] * 2**20),
        int(t["bucket_mb"] * 2**20),
    )
    return terms, resident_baseline(cfg.optimizer)
