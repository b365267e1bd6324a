"""Gradient compression under real mpirun (2 ranks): on the demo task every method ends
within a point of dense accuracy, top-k without error feedback is clearly worse (the
safeguard matters), and both backends follow the same trajectory through a compressor."""

import pytest
from demo_runs import SHORT, demo_accuracy
from test_trainer_jobs import BACKENDS, share, shared_run

MPI = "train.allreduce=mpi"  # the compressors run in hpctrain's MPI engine


def test_compressed_training_reaches_dense_accuracy_and_error_feedback_matters(tmp_path_factory):
    dense = demo_accuracy(tmp_path_factory, SHORT)
    topk = [SHORT, MPI, "train.compression=topk", "compression.ratio=0.01"]
    with_ef = demo_accuracy(tmp_path_factory, *topk)
    without_ef = demo_accuracy(tmp_path_factory, *topk, "compression.error_feedback=false")
    powersgd = demo_accuracy(tmp_path_factory, SHORT, MPI, "train.compression=powersgd")
    assert dense > 0.8  # the demo's own bar
    for acc in (with_ef, powersgd):
        assert acc > dense - 0.01, (acc, dense)
    # Measured at 6 epochs: dense 0.809, top-k 0.808 with error feedback, 0.767 without
    # (at the demo's 12 epochs: 0.817, 0.813, 0.782).
    assert without_ef < with_ef - 0.015, (without_ef, with_ef)


METHODS = ["bf16", "powersgd"]
for _b in BACKENDS:
    for _method in METHODS:  # trained in the launch test_trainer_jobs.py's runs share
        share(2, _b, f"{_method}-compressed", MPI, f"train.compression={_method}",
              "train.max_steps=8", "model.hidden=[32]", "compression.rank=2")  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_both_backends_follow_the_same_trajectory_through_a_compressor(tmp_path_factory, method):
    wt, lt = shared_run(tmp_path_factory, 2, "torch", f"{method}-compressed")
    wf, lf = shared_run(tmp_path_factory, 2, "tensorflow", f"{method}-compressed")
    assert lt == pytest.approx(lf, abs=1e-4)
    for k in wt:
        assert abs(wt[k] - wf[k]).max() < 1e-4, k


@pytest.mark.extended  # the compressors are the MPI engine's, shared by both backends: torch
# converges through top-k above, TensorFlow follows torch's trajectory through them above
def test_tensorflow_converges_through_a_lossy_compressor(tmp_path_factory):
    """The TF backend trains the demo through top-k 1% with error feedback to within a
    point of its dense run (shared with the bf16 test)."""
    dense = demo_accuracy(tmp_path_factory, SHORT, "backend=tensorflow")
    topk = ["train.compression=topk", "compression.ratio=0.01"]
    acc = demo_accuracy(tmp_path_factory, SHORT, MPI, "backend=tensorflow", *topk)
    assert dense > 0.8
    assert acc > dense - 0.01, (acc, dense)
