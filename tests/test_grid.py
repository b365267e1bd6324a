"""The process grid's arithmetic (no MPI): degrees, coordinates, and refusals."""

import pytest

from hpctrain.runtime.grid import GridShape


def test_data_degree_is_what_the_other_axes_leave():
    shape, problem = GridShape.infer(8, pipe=2, expert=2)
    assert problem is None
    assert (shape.data, shape.expert, shape.pipe, shape.tensor) == (2, 2, 2, 1)


@pytest.mark.parametrize(
    "pipe,expert,tensor", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]
)
def test_coordinates_and_ranks_are_inverse_and_pipe_neighbours_are_consecutive(
    pipe, expert, tensor
):
    shape, _ = GridShape.infer(16, pipe, expert, tensor)
    seen = set()
    for rank in range(16):
        c = shape.coords(rank)
        assert shape.rank_of(**c) == rank
        seen.add(tuple(c.values()))
        if c["pipe"] + 1 < pipe:  # the next stage of the same replica is tensor ranks later
            nxt = shape.rank_of(**{**c, "pipe": c["pipe"] + 1})
            assert nxt - rank == tensor
    assert len(seen) == 16


def test_an_impossible_grid_names_every_factor():
    _, problem = GridShape.infer(6, pipe=4)
    assert problem == (
        "world size 6 is not divisible by pipe 4 x expert 1 x tensor 1 = 4: "
        "launch a multiple of 4 ranks"
    )
    assert "must be >= 1" in GridShape.infer(4, pipe=0)[1]


def test_a_tensor_axis_transport_over_other_ranks_is_refused():
    """TensorGroup.with_transport: the transport must be the axis's ranks in its order."""
    from types import SimpleNamespace

    from hpctrain.tensor.parallel import TensorGroup

    axis = SimpleNamespace(rank=1, size=2)
    with pytest.raises(ValueError, match="transport is rank 0 of 2, the axis rank 1 of 2"):
        TensorGroup(axis).with_transport(SimpleNamespace(rank=0, size=2))
    same = SimpleNamespace(rank=1, size=2)
    assert TensorGroup(axis).with_transport(same).transport is same
    assert TensorGroup(None).with_transport(same).transport is None  # one rank: nothing to sum
