"""Inside every rank: the World's layout equals what MPI and Open MPI's launcher say."""

import os

import numpy as np
from mpi4py import MPI

from hpctrain.runtime import world


def test_rank_discovery_matches_mpi():
    w = world()
    comm = MPI.COMM_WORLD
    assert (w.rank, w.size) == (comm.Get_rank(), comm.Get_size())
    assert w.rank == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert w.size == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert w.local_rank == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert w.local_size == int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    assert w.layout.node == 0 and w.layout.nodes == 1  # one machine
    assert w.layout.launcher == "mpirun (Open MPI)"
    # Every rank holds a distinct rank number: their sum is 0 + 1 + ... + (size - 1).
    total = w.allreduce_array(np.array([w.rank], dtype=np.int64), "sum")
    assert total[0] == w.size * (w.size - 1) // 2


def test_role_split_gives_sub_communicators():
    w = world()
    sub = w.split("test-parity", w.rank % 2)
    assert sub.Get_size() == (w.size + 1 - w.rank % 2) // 2
    assert w.split("test-parity", 0) is sub  # cached by name


def test_agree_raises_on_every_rank_with_the_failing_ranks_message():
    w = world()
    err = "disk full" if w.rank == w.size - 1 else None
    try:
        w.agree(err)
    except Exception as exc:  # noqa: BLE001
        assert f"rank(s) {w.size - 1}: disk full" in str(exc)
        assert exc.agreed
    else:
        raise AssertionError("agree() did not raise")


def test_check_uniform_names_the_odd_rank():
    w = world()
    shape = (17, 3) if w.rank != 1 else (17, 4)
    try:
        w.check_uniform(shape, "gradient shape")
    except Exception as exc:  # noqa: BLE001
        assert "gradient shape differs between ranks" in str(exc)
        assert "(17, 4) on rank(s) 1" in str(exc)
    else:
        raise AssertionError("check_uniform() did not raise")
    w.check_uniform((5, 5), "same everywhere")


def test_started_allreduce_arrives_after_other_collectives():
    """A started reduction may stay in flight across other collectives (the trainer's
    step metrics travel while the next step runs) and still sums every rank's values."""
    w = world()
    first = w.start_allreduce_array(np.array([w.rank, 1.0]), "sum", "test started 1")
    between = w.allreduce_array(np.array([2 * w.rank]), "max", "test in between")
    second = w.start_allreduce_array(np.array([w.rank + 1.0]), "max", "test started 2")
    assert between[0] == 2 * (w.size - 1)
    np.testing.assert_array_equal(second.wait(), [w.size])
    np.testing.assert_array_equal(first.wait(), [w.size * (w.size - 1) / 2, w.size])
    np.testing.assert_array_equal(first.wait(), [w.size * (w.size - 1) / 2, w.size])


def test_auto_gradient_engine_is_the_same_on_every_rank():
    """A node with a spare core must not pick Horovod while a full node picks MPI."""
    from hpctrain.backends.gradient_engine import choose
    from hpctrain.config import Config

    w = world()
    cores = 1 if w.rank == w.size - 1 else 64  # only the last rank's node is full
    engine, _ = choose(Config.load(None), local_ranks=1, threads=1, cores=cores, world=w)
    assert engine == "mpi"
    engine, _ = choose(Config.load(None), local_ranks=1, threads=1, cores=64, world=w)
    assert engine == "horovod"


def test_gather_arrays_brings_every_ranks_state_to_root_in_arrays_it_owns():
    """A checkpoint's gather (pipeline stages, tensor slices, experts): large arrays go
    as raw messages into arrays the root owns, small values with the names; a rank with
    nothing sends None; over the world and over a grid axis."""
    from hpctrain.runtime.grid import ProcessGrid

    w = world()

    def state(r):
        if r == 1 and w.size > 2:
            return None  # a rank that holds nothing to save
        big = np.arange(40_000, dtype=np.float32).reshape(200, 200) + r
        return {"model/w": big, "model/b": np.full(3, r, np.float64), "optimizer/step": r + 7}

    for comm in (w, ProcessGrid(w, tensor=2).tensor):
        got = comm.gather_arrays(state(comm.rank), root=0)
        if comm.rank != 0:
            assert got is None
            continue
        assert len(got) == comm.size
        for r, part in enumerate(got):
            want = state(r)
            if want is None:
                assert part is None
                continue
            assert sorted(part) == sorted(want) and part["optimizer/step"] == r + 7
            for k in ("model/w", "model/b"):
                np.testing.assert_array_equal(part[k], want[k])
                assert part[k].dtype == want[k].dtype
            if r != 0:
                assert part["model/w"].flags.owndata  # received, not a view of a pickle
