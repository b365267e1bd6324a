"""Horovod's allreduce (torch and TF) equals mpi4py's MPI Allreduce, in every rank."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.runtime import world

DTYPES = [np.float32, np.float64, np.int32, np.int64]
DIMS = [1, 2, 3]


def _local_tensor(dtype, dims, rank):
    rng = np.random.default_rng(100 + rank)
    shape = (17,) * dims
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _mpi_reference(local, average):
    """MPI_Allreduce sum; for an average, divided by size (integers truncate toward zero,
    as Horovod does for both frameworks)."""
    out = np.empty_like(local)
    MPI.COMM_WORLD.Allreduce(local, out, op=MPI.SUM)
    if average:
        size = MPI.COMM_WORLD.Get_size()
        if np.issubdtype(local.dtype, np.integer):
            return (np.sign(out) * (np.abs(out) // size)).astype(local.dtype)
        return (out / size).astype(local.dtype)
    return out


# Each fixture shuts its Horovod down after this module: an initialised Horovod's
# background thread keeps rank 0 busy (a whole core while idle, measured), which cost the
# modules after this one 8 s of the np-2 job's 27. (hpctrain itself never shuts Horovod
# down: with its fusion threshold and cycle time both set, Horovod 0.28.1 crashes in the
# next init, docs/limits.md; neither is set here, and nothing here inits it again.)
@pytest.fixture(scope="module")
def hvd_torch():
    import horovod.torch as hvd

    if not hvd.is_initialized():
        hvd.init(comm=world().comm)
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="module")
def hvd_tf():
    if world().size > 2:  # TensorFlow's import in 4 ranks on 2 cores: 9.6 s of 25
        pytest.skip("TensorFlow's Horovod runs in the np-2 job; torch's covers 4 ranks")
    import horovod.tensorflow as hvd

    if not hvd.is_initialized():
        hvd.init(comm=world().comm)
    yield hvd
    hvd.shutdown()


def _tol(dtype, size):
    return 0 if np.issubdtype(dtype, np.integer) else (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
def test_torch_allreduce_equals_mpi(hvd_torch, dtype, dims, average):
    import torch

    hvd = hvd_torch
    local = _local_tensor(dtype, dims, hvd.rank())
    op = hvd.Average if average else hvd.Sum
    got = hvd.allreduce(
        torch.from_numpy(local), op=op, name=f"t.{np.dtype(dtype).name}.{dims}.{average}"
    ).numpy()
    want = _mpi_reference(local, average)
    assert got.dtype == local.dtype and got.shape == local.shape
    np.testing.assert_allclose(
        got, want, rtol=_tol(dtype, hvd.size()), atol=_tol(dtype, hvd.size())
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
def test_tensorflow_allreduce_equals_mpi(hvd_tf, dtype, dims, average):
    import tensorflow as tf

    hvd = hvd_tf
    local = _local_tensor(dtype, dims, hvd.rank())
    op = hvd.Average if average else hvd.Sum
    got = hvd.allreduce(
        tf.constant(local), op=op, name=f"tf.{np.dtype(dtype).name}.{dims}.{average}"
    ).numpy()
    want = _mpi_reference(local, average)
    assert got.dtype == local.dtype and got.shape == local.shape
    np.testing.assert_allclose(
        got, want, rtol=_tol(dtype, hvd.size()), atol=_tol(dtype, hvd.size())
    )


def test_torch_mismatched_shapes_raise_instead_of_hanging(hvd_torch):
    import torch

    hvd = hvd_torch
    tensor = torch.ones([17 + hvd.rank()] * 3)
    with pytest.raises(Exception, match="(?i)mismatch"):  # noqa: B017 - Horovod's own type
        hvd.allreduce(tensor, name="mismatched.torch")


def test_tensorflow_mismatched_shapes_raise_instead_of_hanging(hvd_tf):
    import tensorflow as tf

    hvd = hvd_tf
    tensor = tf.ones([17 + hvd.rank()] * 3)
    with pytest.raises(Exception, match="(?i)mismatch"):  # noqa: B017
        hvd.allreduce(tensor, name="mismatched.tf")
