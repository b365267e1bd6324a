"""Local SGD (`train.sync_every`) under real mpirun (2 ranks): warm-up steps equal
synchronous training exactly, replicas end identical, it reaches dense accuracy on the
demo with a quarter of the traffic, and the schedule is what the docs say."""

import json
import re

import pytest
from mpirun import HPCTRAIN, ROOT, mpirun
from test_trainer_jobs import _assert_same_weights, _train_many

from hpctrain.exchange.local_sgd import LocalSchedule

DEMO = str(ROOT / "configs" / "demo.yaml")


def test_schedule_syncs_the_warmup_then_averages_every_h_steps():
    s = LocalSchedule(every=3, warmup=2)
    assert [s.synchronous(t) for t in range(4)] == [True, True, False, False]
    assert [t for t in range(12) if s.average_after(t)] == [4, 7, 10]


def test_warmup_is_synchronous_and_replicas_end_identical(tmp_path):
    common = ["train.allreduce=mpi", "train.max_steps=7", "model.hidden=[32]"]
    runs = _train_many(
        tmp_path,
        2,
        {
            "sync": common,
            "warm": [*common, "train.sync_every=4", "train.local_sgd_warmup_steps=7"],
            # 7 steps with H=3 after 2 synchronous ones: the last two are local, then
            # averaged at the end (_train_many asserts every rank holds the same parameters).
            "local": [*common, "train.sync_every=3", "train.local_sgd_warmup_steps=2"],
        },
    )  # one launch, three runs (each reseeds the process)
    (sync, sync_losses), (warm, _), (local, local_losses) = runs.values()
    _assert_same_weights(warm, sync, 1e-6)  # every step inside the warm-up: synchronous
    assert local_losses[:2] == pytest.approx(sync_losses[:2], abs=1e-6)
    assert max(abs(local[k] - sync[k]).max() for k in sync) > 1e-6  # it did step locally


def test_local_sgd_reaches_dense_accuracy_with_a_quarter_of_the_traffic(tmp_path):
    args = ["train", "--config", DEMO, "--run-dir", str(tmp_path / "run"), "--new"]
    for o in [
        "train.allreduce=mpi",
        "checkpoint.enabled=false",
        "train.sync_every=4",
        "train.local_sgd_warmup_steps=100",
        "train.log_every=1",
    ]:
        args += ["--set", o]
    job = mpirun(2, HPCTRAIN, *args, timeout=300)
    assert job.returncode == 0, job.output
    acc = float(re.search(r"val_accuracy=([0-9.]+)", job.output).group(1))
    assert acc > 0.817 - 0.01, acc  # dense: 0.817 (tests/test_compression_jobs.py)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    sent = [x["comm_bytes"] for x in steps if x["event"] == "step" and x["step"] > 100]
    # One parameter average (the gradients' size) every 4th step, nothing in between.
    assert sent and sum(sent) / len(sent) == pytest.approx(max(sent) / 4, rel=0.05)
