"""Render-time checks that a job's world size fits its config (no MPI, no framework).

The same rules the strategies apply when the job starts, checked before it queues:
- pipeline and tensor parallelism: ranks = pipeline.stages x parallel.tensor x replicas,
  so a multiple of a replica's ranks, at least one replica (`JobShape`);
- parameter server: at least one worker beside the ps.servers servers;
- mixture of experts (`model.moe`): experts split evenly over each expert-parallel
  group (`parallel.expert` ranks, the whole job when unset), and groups tile the job;
- the training split fills one global batch (batch x accumulation x replicas), when
  the split is known before the job: the synthetic task's data.train_samples, or an
  HDF5 data.path this machine can open (its metadata only). A file this machine cannot
  see is left to the job, which checks it at start.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..data import DataOptions, batch_problem, expand_path, open_dataset
from ..errors import DataError
from ..models.zoo import has_moe
from ..moe.options import moe_options
from ..shape import JobShape


def training_split(cfg):
    """(where, training samples) of the split the job will train on, or None when this
    machine cannot tell (the benchmark source, an HDF5 file it cannot open)."""
    data = cfg.data
    if data["source"] == "synthetic":
        return SimpleNamespace(path="data.train_samples", train_size=data["train_samples"])
    if data["source"] != "hdf5":
        return None
    try:
        return open_dataset(expand_path(data["path"], "data.path"), DataOptions.from_config(cfg))
    except DataError:
        return None


def world_size_problems(cfg, ranks: int, where: str, split=None) -> list[str]:
    """Why `ranks` ranks cannot run `cfg`; `where` says how the ranks were asked for;
    `split`: training_split(cfg), whose size must fill one global batch."""
    problems = []
    shape = JobShape.of(cfg, ranks)
    if split is not None and shape.tiles:
        pipeline = cfg["strategy"] == "pipeline"
        key = "pipeline.microbatches" if pipeline else "train.grad_accum"
        accum = cfg.pipeline["microbatches"] if pipeline else cfg.train["grad_accum"]
        problem = batch_problem(split, shape.replicas, cfg.train["batch_size"], accum, key)
        if problem:
            problems.append(f"{problem} at {where}")
    if not shape.tiles and shape.servers:
        servers = shape.servers
        problems.append(
            f"ps.servers={servers} leaves no worker: {where} gives {ranks} rank(s), "
            f"at least {servers + 1} are needed"
        )
    elif not shape.tiles:
        n = shape.ranks_per_replica
        fit = f"{n}, {2 * n}, {3 * n}, ..."
        asks = [f"pipeline.stages={shape.stages}"] if shape.stages > 1 else []
        asks += [f"parallel.tensor={shape.tensor}"] if shape.tensor > 1 else []
        problems.append(
            f"{' x '.join(asks)} needs a multiple of {n} ranks ({fit}); {where} gives {ranks}"
        )
    if has_moe(cfg.model):
        experts = moe_options(cfg.model["moe"])["experts"]
        group = cfg.parallel["expert"] or ranks
        if ranks % group:
            problems.append(
                f"parallel.expert={group} does not divide the {ranks} ranks {where} gives"
            )
        elif experts % group:
            problems.append(
                f"model.moe.experts={experts} cannot be split evenly over {group} "
                f"expert-parallel ranks ({where}): use a rank count that divides {experts} "
                "or set parallel.expert"
            )
    return problems
