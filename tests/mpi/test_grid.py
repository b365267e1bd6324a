"""The process grid inside every rank of a real mpirun job (np=2 and np=4)."""

import numpy as np
import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime import world
from hpctrain.runtime.grid import ProcessGrid


def test_axes_group_exactly_the_ranks_that_share_the_other_coordinates():
    w = world()
    g = ProcessGrid(w, pipe=2)
    assert g.stages == 2 and g.pipe.size == 2 and g.data.size == w.size // 2
    assert g.replicas.size == g.data.size and g.expert.size == 1 and g.tensor.size == 1
    # Summing world ranks over an axis gives the ranks that share the other coordinates.
    for name, axis in g.axes.items():
        got = axis.allreduce_array(np.array([w.rank], np.int64), "sum", f"grid {name}")[0]
        c = g.coord
        if name == "replicas":
            members = [r for r in range(w.size) if g.shape.coords(r)["pipe"] == c["pipe"]]
        else:
            members = [
                r
                for r in range(w.size)
                if all(v == c[k] for k, v in g.shape.coords(r).items() if k != name)
            ]
        assert got == sum(members), (name, members)
        assert axis.rank == sorted(members).index(w.rank)
        # what torch.distributed's groups over the same axis are built from
        if name in ("replicas", "data", "expert", "pipe", "tensor"):
            assert g.members(name) == sorted(members), name
            gathered = axis.allgather_object(w.rank, f"grid {name} members")
            assert gathered == g.members(name), name


def test_the_expert_x_tensor_ranks_are_listed_in_their_communicator_order():
    """What the experts' process group is built from with tensor parallelism."""
    w = world()
    g = ProcessGrid(w, tensor=2, expert=w.size // 2)
    axis = g.experts_x_tensor()
    gathered = axis.allgather_object(w.rank, "grid experts-x-tensor members")
    assert gathered == g.members("experts-x-tensor") and len(gathered) == w.size


def test_an_expert_axis_smaller_than_the_world():
    w = world()
    if w.size < 4:
        pytest.skip("needs 4 ranks")
    g = ProcessGrid(w, expert=2)
    assert g.expert.size == 2 and g.data.size == w.size // 2 and g.replicas.size == w.size
    assert g.coord["expert"] == w.rank % 2


def test_an_impossible_grid_is_refused_on_every_rank():
    w = world()
    with pytest.raises(ConfigError, match=f"world size {w.size} is not divisible by pipe 3"):
        ProcessGrid(w, pipe=3)
