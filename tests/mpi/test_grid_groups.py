"""torch.distributed groups over the process grid's axes (backends/torch_pg.grid_groups)
in every rank of a real job (np 2 and 4): each axis's group holds exactly the ranks of
the grid's MPI communicator for that axis, in the same order, and the tensor-parallel
`f`/`g` sums over it equal the MPI path's bit for bit (integer-valued inputs)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpctrain.backends import torch_tensor
from hpctrain.backends.torch_pg import grid_groups
from hpctrain.backends.torch_transport import ProcessGroupTransport
from hpctrain.runtime import world
from hpctrain.runtime.grid import ProcessGrid
from hpctrain.tensor.parallel import TensorGroup

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def grid_and_transports():
    w = world()
    grid = ProcessGrid(w, tensor=2)
    groups = grid_groups(grid, "gloo", 60.0, ("replicas", "tensor"))
    transports = {
        axis: ProcessGroupTransport(grid.axes[axis], "gloo", 60.0, CPU, group=group)
        for axis, group in groups.items()
    }
    yield grid, transports
    dist.destroy_process_group()


def test_each_axis_group_holds_the_axis_ranks_in_its_order(grid_and_transports):
    grid, transports = grid_and_transports
    w = grid.world
    for axis, t in transports.items():
        assert (t.rank, t.size) == (grid.axes[axis].rank, grid.axes[axis].size), axis
        got = t.allreduce_inplace(torch.tensor([float(w.rank)]), "sum", f"{axis} ranks")
        assert float(got[0]) == sum(grid.members(axis)), axis
        # the group's rank order is the axis's: rank r of the group sends r
        slots = torch.zeros(t.size)
        slots[t.rank] = float(w.rank)
        t.allreduce_inplace(slots, "sum", f"{axis} order")
        assert slots.tolist() == [float(r) for r in grid.members(axis)], axis


def test_tensor_parallel_sums_on_the_group_equal_the_mpi_path(grid_and_transports):
    grid, transports = grid_and_transports
    host = TensorGroup(grid.tensor)
    device = host.with_transport(transports["tensor"])
    assert device.transport is transports["tensor"] and host.transport is None
    rng = np.random.default_rng(7 + grid.world.rank)
    x = torch.from_numpy(rng.integers(-9, 9, (3, 4, 8)).astype(np.float32))
    outs = []
    for group in (host, device):
        leaf = x.clone().requires_grad_(True)
        y = torch_tensor.reduce_from_tensor_axis(
            torch_tensor.copy_to_tensor_axis(leaf, group), group
        )
        y.backward(torch.ones_like(y) * (1 + grid.coord["tensor"]))
        outs.append((y.detach(), leaf.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    total = grid.tensor.allreduce_array(x.numpy().copy(), "sum", "reference sum")
    np.testing.assert_array_equal(outs[1][0].numpy(), total)
    assert float(outs[1][1][0, 0, 0]) == sum(1 + t for t in range(grid.shape.tensor))
