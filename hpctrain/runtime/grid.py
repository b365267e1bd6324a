"""The P x D process grid of pipeline parallelism, cut from the world with two splits.

World rank r holds stage `r % P` of replica `r // P`, so a replica's stages are
consecutive ranks (on one node when P divides the ranks per node) and the activation
traffic, the heaviest, stays on shared memory; the D copies of a stage, which only meet
once per step to average gradients, are P ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .world import World


@dataclass(frozen=True)
class Grid:
    """This rank's place in the grid and the two communicators it needs."""

    stages: int  # P: pipeline depth
    replicas: int  # D: copies of each stage (data parallelism)
    stage: int
    replica: int
    pipe: object  # the P ranks of my replica, ranked by stage (activations, gradients)
    peers: object  # the D ranks holding my stage, ranked by replica (gradient averaging)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def stage_groups(self) -> list[list[int]]:
        """World ranks of each stage's replicas, for every stage (the same on all ranks)."""
        return [[s + d * self.stages for d in range(self.replicas)] for s in range(self.stages)]


def pipeline_grid(world: World, stages: int) -> Grid:
    """Split the world into P stages x D replicas; an impossible P fails on every rank."""
    problem = None
    if stages < 1:
        problem = f"pipeline.stages must be >= 1, got {stages}"
    elif world.size % stages:
        problem = (
            f"world size {world.size} is not divisible by pipeline.stages={stages}: "
            f"launch a multiple of {stages} ranks (stages x data-parallel replicas)"
        )
    world.agree(problem)
    stage, replica = world.rank % stages, world.rank // stages
    pipe = world.split(f"pipeline.P{stages}.pipe", replica, key=stage)
    peers = world.split(f"pipeline.P{stages}.peers", stage, key=replica)
    return Grid(stages, world.size // stages, stage, replica, pipe, peers)
