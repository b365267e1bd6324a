"""Gradient compression under real mpirun (2 ranks): on the demo task every method ends
within a point of dense accuracy, top-k without error feedback is clearly worse (the
safeguard matters), and both backends follow the same trajectory through a compressor."""

import pytest
from demo_runs import demo_accuracy
from test_trainer_jobs import _train

MPI = "train.allreduce=mpi"  # the compressors run in hpctrain's MPI engine


def test_compressed_training_reaches_dense_accuracy_and_error_feedback_matters(tmp_path_factory):
    dense = demo_accuracy(tmp_path_factory)
    topk = [MPI, "train.compression=topk", "compression.ratio=0.01"]
    with_ef = demo_accuracy(tmp_path_factory, *topk)
    without_ef = demo_accuracy(tmp_path_factory, *topk, "compression.error_feedback=false")
    powersgd = demo_accuracy(tmp_path_factory, MPI, "train.compression=powersgd")
    assert dense > 0.8  # the demo's own bar
    for acc in (with_ef, powersgd):
        assert acc > dense - 0.01, (acc, dense)
    # Measured 0.813 with error feedback vs 0.782 without (dense 0.817).
    assert without_ef < with_ef - 0.015, (without_ef, with_ef)


@pytest.mark.parametrize("method", ["bf16", "powersgd"])
def test_both_backends_follow_the_same_trajectory_through_a_compressor(tmp_path, method):
    common = [
        "train.allreduce=mpi",
        f"train.compression={method}",
        "train.max_steps=8",
        "model.hidden=[32]",
        "compression.rank=2",
    ]
    wt, lt = _train(tmp_path, f"{method}-torch", 2, "backend=torch", *common)
    wf, lf = _train(tmp_path, f"{method}-tf", 2, "backend=tensorflow", *common)
    assert lt == pytest.approx(lf, abs=1e-4)
    for k in wt:
        assert abs(wt[k] - wf[k]).max() < 1e-4, k


def test_tensorflow_converges_through_a_lossy_compressor(tmp_path_factory):
    """The TF backend trains the demo through top-k 1% with error feedback to within a
    point of dense (dense: 0.817 with torch; the backends follow the same trajectory)."""
    acc = demo_accuracy(
        tmp_path_factory,
        MPI,
        "backend=tensorflow",
        "train.compression=topk",
        "compression.ratio=0.01",
    )
    assert acc > 0.817 - 0.01, acc
