"""`hpctrain plan-memory`: a configuration's per-rank memory at a world size, for every
ZeRO stage, before anything is launched (no MPI, no model in memory).

The terms are exchange/memory_plan.py's; the model's shapes and activations come from
the torch backend on fake tensors (backends/torch_plan.py); the baseline, what a rank
holds before its model, is measured in this process after loading what a rank loads
(torch, its thread pools, the optimizer's code), so run it where the job runs.
"""

from __future__ import annotations

import argparse
import math

MIB = 1 << 20


def data_ranks(cfg, world_size: int) -> int:
    """The data-parallel ranks ZeRO shards over: the world over the tensor axis."""
    from .errors import ConfigError

    tensor = cfg.parallel["tensor"]
    if world_size < 1 or world_size % tensor:
        raise ConfigError(
            f"--np {world_size}: a positive multiple of parallel.tensor={tensor} is needed"
        )
    return world_size // tensor


def input_spec(cfg):
    """What the model is built for: the synthetic task's input, or an HDF5 file's (its
    metadata, and its labels read once for the classes unless the file says them: the
    output layer's width; it was planned as the synthetic task's whatever data.path
    held). Raises DataError for a file a run would refuse."""
    from .data import DataOptions, benchmark_input_spec, expand_path, inspect_dataset

    if cfg.data["source"] != "hdf5":
        return benchmark_input_spec(cfg.data)
    path = expand_path(cfg.data["path"], "data.path")
    return inspect_dataset(path, DataOptions.from_config(cfg)).input_spec


def plan_memory(cfg, world_size: int, limit_mb: float | None, gpu_mb: float | None = None) -> str:
    """The report: the model, the world, and the table of stages (peak per rank). GPU
    ranks (runtime.device=cuda, train.offload, or a GPU memory given) get the GPU's
    peak and the host's in separate columns."""
    from .backends.groups import ModelGroups
    from .backends.torch_plan import plan_stages
    from .errors import ConfigError
    from .exchange.memory_plan import STAGES, table
    from .models.zoo import has_moe
    from .tensor.parallel import TensorGroup

    if cfg.backend != "torch" or cfg.strategy not in ("data_parallel", "pipeline"):
        raise ConfigError(
            "plan-memory plans the torch backend's data-parallel strategy (ZeRO 0-3, "
            "tensor parallelism) and its pipeline (each stage); not backend "
            f"{cfg.backend} with strategy {cfg.strategy}"
        )
    if has_moe(cfg.model):
        raise ConfigError(
            "plan-memory: mixture-of-experts models are not planned before launch (their "
            "experts depend on the expert layout); a run checks its plan at start"
        )
    tensor = cfg.parallel["tensor"]
    groups = ModelGroups(tensor=TensorGroup.planned(tensor)) if tensor > 1 else ModelGroups()
    t = cfg.train
    gpu = gpu_mb is not None or cfg.runtime["device"] == "cuda" or t["offload"] != "none"
    if cfg.strategy == "pipeline":
        return _plan_pipeline(cfg, world_size, groups, limit_mb, gpu_mb, gpu)
    n = data_ranks(cfg, world_size)
    inp = input_spec(cfg)
    planned = plan_stages(cfg, inp, groups, n, STAGES, gpu=gpu)
    if planned is None:
        raise ConfigError(
            f"model {cfg.model['name']!r}: plan-memory plans zoo models; a user's model "
            "is checked against the rank's limit once built (runtime.memory_check)"
        )
    shape, plans, baseline = planned
    psi = sum(shape.sizes)
    head = (
        f"model {cfg.model['name']}: {psi:,} dense parameters per rank"
        + (f" (this rank's 1/{tensor} of the split layers)" if tensor > 1 else "")
        + (f", {shape.expert_elements:,} in local experts" if shape.expert_elements else "")
        + f"; {world_size} rank(s) = {n} data-parallel x {tensor} tensor; optimizer "
        f"{cfg.optimizer['name']}, micro-batch {t['batch_size']}; MiB per rank:"
    )
    limit = None if limit_mb is None else limit_mb * MIB
    where = (
        "GPU peak = every term (GPU memory); host peak = baseline (this process, before "
        f"a model) + what train.offload={t['offload']} keeps on the host (ZeRO stages); "
        if gpu
        else "peak = baseline (this process, before a model) + every term; "
    )
    notes = (
        where + "ZeRO-3 gathers "
        f"units of train.zero_unit_mb={t['zero_unit_mb']} MB, two at a time; a run's "
        "baseline also holds its training split when it fits data.in_memory_mb "
        f"({cfg.data['in_memory_mb']:g} MiB; one copy per node, on its first rank)"
    )
    gpu_limit = None if gpu_mb is None else gpu_mb * MIB
    notes += _checkpoint_note(cfg, inp, world_size, gpu, tensor > 1)
    return "\n".join([head, table(plans, baseline, limit, gpu, gpu_limit), notes])


def _checkpoint_note(cfg, inp, world_size: int, gpu: bool, gathered: bool) -> str:
    """Rank 0's host copy for a gathered checkpoint, outside the table (its other ranks
    do not hold it): strategies/checkpoint_memory.py. `gathered`: every row's state is
    gathered for a save (tensor parallelism, a pipeline), not only ZeRO's."""
    from .strategies.checkpoint_memory import checkpoint_host_bytes

    zero = checkpoint_host_bytes(cfg, inp, 0, world_size, gpu, gathers=True)
    if not zero:
        return (
            ". Checkpoints: every rank writes its own part (checkpoint.sharded), rank 0 "
            "holds no gathered copy"
            if cfg.checkpoint["enabled"]
            else ""
        )
    plain = zero if gathered else checkpoint_host_bytes(cfg, inp, 0, world_size, gpu, False)
    held = (
        f"{zero / MIB:,.0f} MiB"
        if plain == zero
        else f"{f'{plain / MIB:,.0f} MiB' if plain else 'nothing'} without ZeRO, "
        f"{zero / MIB:,.0f} MiB with ZeRO"
    )
    return (
        f". A gathered checkpoint (checkpoint.async={str(cfg.checkpoint['async']).lower()}, "
        f"sharded={str(cfg.checkpoint['sharded']).lower()}) adds on rank 0 alone {held} "
        "of host memory, not in the table (the run's check counts it)"
    )


def _plan_pipeline(cfg, world_size: int, groups, limit_mb, gpu_mb, gpu: bool) -> str:
    """The report of a pipeline: one row per stage, at the configured ZeRO stage (0 or
    1), each rank of the stage holding its layers' state and the activations of the
    micro-batches its schedule keeps at once (backends/torch_plan.plan_pipeline_stage)."""
    from .backends.torch_plan import plan_pipeline_stage
    from .errors import ConfigError
    from .exchange.memory_plan import table
    from .models import zoo
    from .pipeline.partition import check_partition, parameter_partition, stage_bounds
    from .pipeline.schedule import peak_in_flight, stage_actions
    from .shape import JobShape
    from .strategies.pipeline import config_problem
    from .tensor.parallel import local_layers

    problem = config_problem(cfg, world_size)
    if problem is None and not zoo.is_zoo_model(cfg.model["name"]):
        problem = f"model {cfg.model['name']!r}: plan-memory plans zoo models"
    if problem:
        raise ConfigError(problem)
    p, inp = cfg.pipeline, input_spec(cfg)
    layers = zoo.build_layers(cfg.model, inp)
    problem = check_partition(p["partition"], len(layers), p["stages"])
    if problem:
        raise ConfigError(problem)
    counts = parameter_partition(p["partition"], layers, p["stages"])
    replicas = JobShape.of(cfg, world_size).replicas
    plans, baseline = {}, 0.0
    for s, (start, stop) in enumerate(stage_bounds(counts)):
        held = peak_in_flight(stage_actions(p["schedule"], s, p["stages"], p["microbatches"]))
        local = local_layers(layers[start:stop], cfg.parallel["tensor"])
        terms, baseline = plan_pipeline_stage(
            cfg, inp, layers, start, local, groups, replicas, held, gpu=gpu
        )
        held_text = f"{held} micro-batch{'es' if held > 1 else ''}"
        plans[f"stage {s} (layers {start}-{stop - 1}, holds {held_text})"] = terms
    t = cfg.train
    head = (
        f"model {cfg.model['name']}: pipeline of {p['stages']} stages x "
        f"{cfg.parallel['tensor']} tensor x {replicas} replica{'s' if replicas != 1 else ''} "
        f"= {world_size} rank(s), "
        f"{p['schedule']} schedule, {p['microbatches']} micro-batches of {t['batch_size']}, "
        f"ZeRO-{t['zero']} over each stage's replicas; optimizer {cfg.optimizer['name']}; "
        "MiB per rank:"
    )
    notes = (
        "GPU peak = every term (GPU memory); host peak = the baseline. "
        if gpu
        else "peak = baseline (this process, before a model) + every term. "
    ) + (
        "Stages cut by parameters (pipeline.partition=time is measured at launch). Each "
        "stage's rank holds its layers' parameters, gradients and optimizer state, and "
        "the activations of the micro-batches held (1F1B: at most P - s; GPipe: all)"
    )
    notes += _checkpoint_note(cfg, inp, world_size, gpu, True)
    limit = None if limit_mb is None else limit_mb * MIB
    gpu_limit = None if gpu_mb is None else gpu_mb * MIB
    return "\n".join([head, table(plans, baseline, limit, gpu, gpu_limit), notes])


def _mib(text: str) -> float:
    """A memory size in MiB for --limit-mb / --gpu-mb: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB, a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB, got {text!r}")
    return value


def register(sub, add_config_args) -> dict:
    p = sub.add_parser(
        "plan-memory",
        help="per-rank memory of a configuration at a world size, for each ZeRO stage "
        "(a pipeline: for each of its stages)",
        description="Print, for a configuration and a world size, the bytes one rank "
        "will hold at its peak with ZeRO 0, 1, 2 and 3: parameters, gathered units, "
        "gradients, optimizer state, activations, the step's transients and the "
        "process's baseline; for strategy pipeline, one row per pipeline stage. Nothing "
        "is launched and no model is allocated.",
    )
    add_config_args(p)
    p.add_argument("--np", type=int, required=True, help="the job's world size (ranks)")
    p.add_argument(
        "--limit-mb",
        type=_mib,
        default=None,
        help="mark each stage's fit against MiB per rank",
    )
    p.add_argument(
        "--gpu-mb",
        type=_mib,
        default=None,
        help="GPU ranks: mark each stage's GPU peak against this many MiB per rank "
        "(--limit-mb then marks the host's); implied columns with runtime.device=cuda "
        "or train.offload",
    )
    return {"plan-memory": _cmd_plan_memory}


def _cmd_plan_memory(args) -> int:
    from .config import Config

    cfg = Config.load(args.config, args.overrides)
    print(plan_memory(cfg, args.np, args.limit_mb, args.gpu_mb))
    return 0
