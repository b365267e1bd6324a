"""Render-time checks that a job's world size fits its config (no MPI, no framework).

The same rules the strategies apply when the job starts, checked before it queues:
- pipeline: ranks = pipeline.stages x replicas, so a multiple of the stages, at least
  one replica;
- parameter server: at least one worker beside the ps.servers servers;
- mixture of experts (`model.moe`): experts split evenly over each expert-parallel
  group (`parallel.expert` ranks, the whole job when unset), and groups tile the job.
"""

from __future__ import annotations

from ..models.zoo import has_moe
from ..moe.options import moe_options


def world_size_problems(cfg, ranks: int, where: str) -> list[str]:
    """Why `ranks` ranks cannot run `cfg`; `where` says how the ranks were asked for."""
    problems = []
    strategy = cfg["strategy"]
    if strategy == "pipeline":
        stages = cfg.pipeline["stages"]
        if ranks < stages or ranks % stages:
            fit = f"{stages}, {2 * stages}, {3 * stages}, ..."
            problems.append(
                f"pipeline.stages={stages} needs a multiple of {stages} ranks ({fit}); "
                f"{where} gives {ranks}"
            )
    if strategy == "parameter_server":
        servers = cfg.ps["servers"]
        if ranks <= servers:
            problems.append(
                f"ps.servers={servers} leaves no worker: {where} gives {ranks} rank(s), "
                f"at least {servers + 1} are needed"
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
