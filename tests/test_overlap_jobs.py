"""`train.allreduce=overlap` under real mpirun: buckets sent from backward hooks give the
same parameters as the synchronous engine (SGD with momentum and Adam, clipping,
accumulation, several buckets), in both backends."""

import pytest
from test_trainer_jobs import _assert_same_weights, share, shared_run

COMMON = ["train.max_steps=5", "model.hidden=[64, 32]", "train.batch_size=8"]
TORTURE = [
    "train.grad_accum=2",
    "train.clip_norm=0.05",  # small enough to clip: the clip must see the averaged gradients
    "train.bucket_mb=0.004",  # ~4 KB buckets: several per step, started during backward
]


CASES = [("torch", 2, "sgd"), ("torch", 4, "adam"), ("tensorflow", 2, "sgd")]
for _backend, _np, _optimizer in CASES:  # trained in the launches other tests' runs share
    _opts = [f"optimizer.name={_optimizer}", *COMMON, *TORTURE]
    if _optimizer == "sgd":
        _opts.append("optimizer.momentum=0.9")
    for _engine in ("mpi", "overlap"):
        share(_np, _backend, f"engine-{_engine}-{_optimizer}", *_opts, f"train.allreduce={_engine}")


@pytest.mark.parametrize("backend, np_, optimizer", CASES)
def test_overlap_equals_the_synchronous_engine(tmp_path_factory, backend, np_, optimizer):
    sync, sync_losses = shared_run(tmp_path_factory, np_, backend, f"engine-mpi-{optimizer}")
    over, over_losses = shared_run(tmp_path_factory, np_, backend, f"engine-overlap-{optimizer}")
    _assert_same_weights(over, sync, 1e-6)
    assert over_losses == pytest.approx(sync_losses, abs=1e-6)
