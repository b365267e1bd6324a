"""The communicator groups a model uses inside its forward and backward passes.

`ModelGroups` holds the tensor-parallel group (Megatron's f/g allreduces) and the
expert-parallel group (MoE all-to-alls, expert gradients averaged over their copies).
Both are made from the process grid (`ProcessGrid` owns every communicator) by the
strategy, and reach the backend, the model it builds and the stage through their
constructors: no module keeps a group, so two runs in one process never share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..moe.parallel import ExpertGroup
from ..tensor.parallel import TensorGroup


@dataclass(frozen=True)
class ModelGroups:
    """tensor: this rank's tensor axis (TensorGroup(None) without tensor parallelism);
    experts: the expert group (None: the model has no mixture-of-experts layers);
    grid: the process grid they came from (None when built without one), from which a
    backend builds its own library's groups over the same axes (torch.distributed)."""

    tensor: TensorGroup = field(default_factory=TensorGroup)
    experts: ExpertGroup | None = None
    grid: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_grid(cls, grid, moe: bool) -> ModelGroups:
        """The groups of this rank on `grid` (collective when `moe` with tensor
        parallelism: the expert x tensor ranks are split once, see ProcessGrid)."""
        t = grid.shape.tensor
        tensor = TensorGroup(grid.tensor if t > 1 else None)
        if not moe:
            return cls(tensor, grid=grid)
        if t == 1:  # the experts on the grid's expert axis, copies over `data`
            return cls(tensor, ExpertGroup(grid.expert, grid.data), grid)
        # with tensor parallelism on the expert x tensor ranks of one (data, pipe) slot,
        # where each rank of a tensor group routes 1/T of the group's samples
        experts = ExpertGroup(grid.experts_x_tensor(), grid.data, ranks_per_batch=t)
        return cls(tensor, experts, grid)

    @property
    def _token_axis(self) -> str:
        """The grid axis of the experts' token rows (from_grid's expert group)."""
        return "experts-x-tensor" if self.tensor_parallel else "expert"

    @property
    def transport_axes(self) -> tuple[str, ...]:
        """The grid axes these groups exchange over, for a backend to build its own
        transports on (on_transports): the tensor axis, the experts' token rows' axis
        and their copies' ("data")."""
        experts = (self._token_axis, "data") if self.experts is not None else ()
        return ("tensor",) * self.tensor_parallel + experts

    def on_transports(self, transports: dict) -> ModelGroups:
        """These groups with a backend's device-side transports over the same ranks
        ({grid axis: transport} over `transport_axes`, e.g. the process-group
        engines'): the tensor axis's activation sums, the experts' token rows and their
        gradients; an axis not given stays on its MPI communicator."""
        tensor = self.tensor.with_transport(transports.get("tensor"))
        experts = self.experts
        if experts is not None and self._token_axis in transports:
            tokens = transports[self._token_axis]
            experts = experts.with_transports(tokens, transports.get("data"))
        return replace(self, tensor=tensor, experts=experts)

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor.size > 1
