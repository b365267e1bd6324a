"""The communicator groups a model uses inside its forward and backward passes.

`ModelGroups` holds the tensor-parallel group (Megatron's f/g allreduces) and the
expert-parallel group (MoE all-to-alls, expert gradients averaged over their copies).
Both are made from the process grid (`ProcessGrid` owns every communicator) by the
strategy, and reach the backend, the model it builds and the stage through their
constructors: no module keeps a group, so two runs in one process never share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..moe.parallel import ExpertGroup
from ..tensor.parallel import TensorGroup


@dataclass(frozen=True)
class ModelGroups:
    """tensor: this rank's tensor axis (TensorGroup(None) without tensor parallelism);
    experts: the expert group (None: the model has no mixture-of-experts layers)."""

    tensor: TensorGroup = field(default_factory=TensorGroup)
    experts: ExpertGroup | None = None

    @classmethod
    def from_grid(cls, grid, moe: bool) -> ModelGroups:
        """The groups of this rank on `grid` (collective when `moe` with tensor
        parallelism: the expert x tensor ranks are split once, see ProcessGrid)."""
        t = grid.shape.tensor
        tensor = TensorGroup(grid.tensor if t > 1 else None)
        if not moe:
            return cls(tensor)
        if t == 1:  # the experts on the grid's expert axis, copies over `data`
            return cls(tensor, ExpertGroup(grid.expert, grid.data))
        # with tensor parallelism on the expert x tensor ranks of one (data, pipe) slot,
        # where each rank of a tensor group routes 1/T of the group's samples
        return cls(tensor, ExpertGroup(grid.experts_x_tensor(), grid.data, ranks_per_batch=t))

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor.size > 1
