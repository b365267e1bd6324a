"""How a configuration divides a world of ranks: one rule for the strategies, the loop's
learning-rate scaling, elastic restart and SLURM's rank checks (`JobShape.of`).

A data-parallel replica is the set of ranks that hold one copy of the model: one rank,
`parallel.tensor` ranks with tensor parallelism, `pipeline.stages x parallel.tensor`
ranks in a pipeline; parameter-server workers are one rank each and the last
`ps.servers` ranks serve. Arithmetic on a few integers: the same at 4,096 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobShape:
    ranks: int
    stages: int  # pipeline stages (1 outside the pipeline)
    tensor: int  # ranks of a tensor group (parallel.tensor)
    servers: int  # parameter-server ranks (0 outside that strategy)

    @classmethod
    def of(cls, cfg, ranks: int) -> JobShape:
        """The shape of `cfg` (a Config or its dict) on `ranks` ranks."""
        strategy = cfg["strategy"]
        ps = strategy == "parameter_server"
        return cls(
            ranks=ranks,
            stages=cfg["pipeline"]["stages"] if strategy == "pipeline" else 1,
            tensor=1 if ps else cfg["parallel"]["tensor"],
            servers=cfg["ps"]["servers"] if ps else 0,
        )

    @property
    def ranks_per_replica(self) -> int:
        return self.stages * self.tensor

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: what the learning rate and the global batch scale with
        (the workers of a parameter server)."""
        if self.servers:
            return max(0, self.ranks - self.servers)
        return self.ranks // self.ranks_per_replica

    @property
    def tiles(self) -> bool:
        """Whether the ranks divide into whole replicas (and leave a worker beside the
        servers): the condition every strategy checks before it starts."""
        if self.servers:
            return self.ranks > self.servers
        return self.ranks >= self.ranks_per_replica and self.ranks % self.ranks_per_replica == 0

    def global_batch(self, batch_size: int, accum: int) -> int:
        """Samples of one optimizer step: each replica's batch x its accumulation."""
        return batch_size * accum * self.replicas
