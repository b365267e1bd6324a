"""The process grid: the job's ranks as named axes, each a guarded communicator.

Every parallelism asks the grid instead of re-deriving rank arithmetic (torchtitan's
`ParallelDims` + DeviceMesh, here over mpi4py). Degrees `pipe`, `expert` and `tensor`
come from the configuration; `data` is what is left of the world size. Ranks are laid
out innermost first: tensor, pipe, expert, data,

    rank = ((data * E + expert) * P + pipe) * T + tensor

so the axes with the heaviest traffic (tensor-parallel activations, pipeline
activations, expert all-to-alls) join consecutive ranks, which sit on one node when
the degrees divide the ranks per node; data-parallel replicas, which meet once per
step, are the farthest apart.

Each axis is built once with `MPI_Comm_split` and carries its own watchdog, so a rank
missing from an axis collective is named even though the other axes go on. `replicas`
is the data x expert plane: the ranks that hold the same dense parameters (the same
pipeline stage and tensor shard), over which dense gradients are averaged.

Cost: 5 splits and 5 communicator duplicates at start-up, each O(log N) in Open MPI;
nothing per step. At 4,096 ranks that is a few milliseconds once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .comm import GuardedComm

AXES = ("data", "expert", "pipe", "tensor")  # outermost first


@dataclass(frozen=True)
class GridShape:
    """Degrees of the four axes; their product is the world size."""

    data: int = 1
    expert: int = 1
    pipe: int = 1
    tensor: int = 1

    @classmethod
    def infer(cls, world_size: int, pipe: int = 1, expert: int = 1, tensor: int = 1):
        """(shape, problem): `data` is inferred; a problem names every factor."""
        fixed = pipe * expert * tensor
        if min(pipe, expert, tensor) < 1:
            return (
                None,
                f"grid degrees must be >= 1 (pipe={pipe}, expert={expert}, tensor={tensor})",
            )
        if world_size % fixed:
            return None, (
                f"world size {world_size} is not divisible by pipe {pipe} x expert {expert} "
                f"x tensor {tensor} = {fixed}: launch a multiple of {fixed} ranks"
            )
        return cls(world_size // fixed, expert, pipe, tensor), None

    def coords(self, rank: int) -> dict[str, int]:
        t = rank % self.tensor
        p = (rank // self.tensor) % self.pipe
        e = (rank // (self.tensor * self.pipe)) % self.expert
        d = rank // (self.tensor * self.pipe * self.expert)
        return {"data": d, "expert": e, "pipe": p, "tensor": t}

    def rank_of(self, data=0, expert=0, pipe=0, tensor=0) -> int:
        return ((data * self.expert + expert) * self.pipe + pipe) * self.tensor + tensor

    def describe(self) -> str:
        return " x ".join(f"{a} {getattr(self, a)}" for a in AXES)


class ProcessGrid:
    """This rank's coordinates and one guarded communicator per axis (collective build)."""

    def __init__(self, world, pipe: int = 1, expert: int = 1, tensor: int = 1):
        shape, problem = GridShape.infer(world.size, pipe, expert, tensor)
        world.agree(problem, error_type=ConfigError)
        self.world, self.shape = world, shape
        self.coord = shape.coords(world.rank)
        c = self.coord
        tag = f"{shape.data}x{shape.expert}x{shape.pipe}x{shape.tensor}"
        # color: the axis's first rank (same for every member); key: position along it
        leaders = {
            name: shape.rank_of(**{**c, **{name: 0}})
            for name in ("data", "expert", "pipe", "tensor")
        }
        leaders["replicas"] = shape.rank_of(**{**c, "data": 0, "expert": 0})
        self.axes: dict[str, GuardedComm] = {}
        for name, color in leaders.items():
            key = c["data"] * shape.expert + c["expert"] if name == "replicas" else c[name]
            self.axes[name] = world.guarded_split(f"grid.{tag}.{name}", color, key=key)

    # --- axes ------------------------------------------------------------------------
    @property
    def data(self) -> GuardedComm:
        return self.axes["data"]

    @property
    def expert(self) -> GuardedComm:
        return self.axes["expert"]

    @property
    def pipe(self) -> GuardedComm:
        return self.axes["pipe"]

    @property
    def tensor(self) -> GuardedComm:
        return self.axes["tensor"]

    @property
    def replicas(self) -> GuardedComm:
        """data x expert: the ranks holding the same dense parameters."""
        return self.axes["replicas"]

    def experts_x_tensor(self) -> GuardedComm:
        """The expert x tensor ranks of this rank's (data, pipe) slot, key expert * T +
        tensor: where the experts live with tensor parallelism (moe/parallel.py).
        Collective the first time (one more split, every rank), kept in `axes` after."""
        if "experts-x-tensor" not in self.axes:
            c, s = self.coord, self.shape
            self.axes["experts-x-tensor"] = self.world.guarded_split(
                f"grid.{s.data}x{s.expert}x{s.pipe}x{s.tensor}.experts-x-tensor",
                self.rank_of(data=c["data"], pipe=c["pipe"]),
                key=c["expert"] * s.tensor + c["tensor"],
            )
        return self.axes["experts-x-tensor"]

    # --- pipeline shortcuts ---------------------------------------------------------------
    @property
    def stages(self) -> int:
        return self.shape.pipe

    @property
    def stage(self) -> int:
        return self.coord["pipe"]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def replica(self) -> int:
        """Index of this rank's dense replica (data x expert), the data-shard index."""
        return self.replicas.rank

    @property
    def num_replicas(self) -> int:
        return self.replicas.size

    def rank_of(self, **coords) -> int:
        return self.shape.rank_of(**coords)

    def members(self, axis: str) -> list[int]:
        """The world ranks of this rank's `axis` (or `replicas`), in the axis's rank
        order: what another library's groups over the same axis are built from
        (arithmetic only; O(axis size)). Also "experts-x-tensor" (`experts_x_tensor`'s
        ranks, key expert * T + tensor)."""
        c, s = self.coord, self.shape
        if axis == "replicas":
            return [
                s.rank_of(**{**c, "data": d, "expert": e})
                for d in range(s.data)
                for e in range(s.expert)
            ]
        if axis == "experts-x-tensor":
            return [
                s.rank_of(**{**c, "expert": e, "tensor": t})
                for e in range(s.expert)
                for t in range(s.tensor)
            ]
        return [s.rank_of(**{**c, axis: i}) for i in range(getattr(s, axis))]

    def describe(self) -> str:
        return self.shape.describe()
