"""Render-time checks that a job's world size fits its config (no MPI, no framework).

The same rules the strategies apply when the job starts, checked before it queues:
- pipeline and tensor parallelism: ranks = pipeline.stages x parallel.tensor x replicas,
  so a multiple of a replica's ranks, at least one replica (`JobShape`);
- parameter server: at least one worker beside the ps.servers servers;
- mixture of experts (`model.moe`): experts split evenly over each expert-parallel
  group (`parallel.expert` ranks, the whole job when unset), and groups tile the job.
"""

from __future__ import annotations

from ..models.zoo import has_moe
from ..moe.options import moe_options
from ..shape import JobShape


def world_size_problems(cfg, ranks: int, where: str) -> list[str]:
    """Why `ranks` ranks cannot run `cfg`; `where` says how the ranks were asked for."""
    problems = []
    shape = JobShape.of(cfg, ranks)
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
