"""`train.allreduce=overlap` under real mpirun: buckets sent from backward hooks give the
same parameters as the synchronous engine (SGD with momentum and Adam, clipping,
accumulation, several buckets), in both backends."""

import pytest
from test_trainer_jobs import _assert_same_weights, _train

COMMON = ["train.max_steps=5", "model.hidden=[64, 32]", "train.batch_size=8"]
TORTURE = [
    "train.grad_accum=2",
    "train.clip_norm=0.05",  # small enough to clip: the clip must see the averaged gradients
    "train.bucket_mb=0.004",  # ~4 KB buckets: several per step, started during backward
]


@pytest.mark.parametrize(
    "backend, np_, optimizer",
    [("torch", 2, "sgd"), ("torch", 4, "adam"), ("tensorflow", 2, "sgd")],
)
def test_overlap_equals_the_synchronous_engine(tmp_path, backend, np_, optimizer):
    opts = [f"backend={backend}", f"optimizer.name={optimizer}", *COMMON, *TORTURE]
    if optimizer == "sgd":
        opts.append("optimizer.momentum=0.9")
    sync, sync_losses = _train(tmp_path, "sync", np_, *opts, "train.allreduce=mpi")
    over, over_losses = _train(tmp_path, "overlap", np_, *opts, "train.allreduce=overlap")
    _assert_same_weights(over, sync, 1e-6)
    assert over_losses == pytest.approx(sync_losses, abs=1e-6)
