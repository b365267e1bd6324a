"""A resumed run's metrics: a `start` line naming its checkpoint, and TensorBoard's
restart marker so that an abandoned timeline's later steps drop out of its plots.

After `--resume FILE` of an older checkpoint (or a crash after the last one),
metrics.jsonl and tb/ still held the steps the resumed run then trained again, with
nothing to tell the two timelines apart.
"""

from __future__ import annotations

import json
import time

import pytest

from hpctrain.metrics import MetricsWriter

pytest.importorskip("tensorboard")


def _loss_steps(run_dir) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), purge_orphaned_data=True)
    acc.Reload()
    return [(e.step, round(e.value, 3)) for e in acc.Scalars("step/loss")]


def test_a_resumed_run_marks_its_start_and_tensorboard_drops_the_abandoned_steps(tmp_path):
    first = MetricsWriter(tmp_path, True)
    first.start(0, 0, None)
    for step in (10, 20, 30, 40, 50):
        first.write("step", epoch=0, step=step, loss=1.0)
    first.close()
    time.sleep(1.1)  # TensorBoard orders event files by the second in their names

    again = MetricsWriter(tmp_path, True)  # resumed from step 30's checkpoint
    again.start(30, 0, "ckpt-00000030.h5")
    again.write("step", epoch=0, step=40, loss=0.5)
    again.close()

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [(x["step"], x["resumed_from"]) for x in lines if x["event"] == "start"]
    assert starts == [(0, None), (30, "ckpt-00000030.h5")]
    assert _loss_steps(tmp_path) == [(10, 1.0), (20, 1.0), (30, 1.0), (40, 0.5)]


def test_a_start_from_step_0_over_an_earlier_attempts_events_drops_them(tmp_path):
    """A requeue before the first checkpoint starts again at step 0 (`--resume auto`
    with nothing to resume): the earlier attempt's points stayed beside the new ones."""
    first = MetricsWriter(tmp_path, True)
    first.start(0, 0, None)
    for step in (10, 20):
        first.write("step", epoch=0, step=step, loss=1.0)
    first.close()
    time.sleep(1.1)
    again = MetricsWriter(tmp_path, True)
    again.start(0, 0, None)
    again.write("step", epoch=0, step=10, loss=0.5)
    again.close()
    assert _loss_steps(tmp_path) == [(10, 0.5)]
