"""When checkpoints are written and kept, and how a background save reports failures."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.checkpoint import (
    Checkpointer,
    CheckpointPolicy,
    Entry,
    list_checkpoints,
    load,
    resume_checkpoint,
    save,
)
from hpctrain.checkpoint import writer as writer_mod
from hpctrain.config import Config
from hpctrain.errors import CheckpointError, ConfigError


def steps_in(directory) -> list[int]:
    return [s for s, _ in list_checkpoints(directory)]


def state(step: int) -> dict:
    return {"model/w": np.full((4, 4), step, np.float32), "optimizer/step": np.array(step)}


def test_defaults_and_config_errors(tmp_path):
    p = CheckpointPolicy.from_config({}, tmp_path)
    assert p.dir == tmp_path / "checkpoints"
    assert (p.enabled, p.every_steps, p.every_minutes, p.at_epoch_end) == (True, None, 30.0, True)
    assert (p.keep_last, p.keep_best, p.best_metric, p.best_mode) == (3, 0, "val_loss", "min")
    assert (p.async_save, p.resume) == (False, "never")  # as checkpoint.resume in config.py
    with pytest.raises(ConfigError) as info:
        CheckpointPolicy(
            {"every_steps": 0, "best_mode": "lowest", "keep_last": 1.5, "async": "yes", "typo": 1}
        )
    msg = str(info.value)
    for key in ("every_steps", "best_mode", "keep_last", "async", "typo: unknown key"):
        assert f"checkpoint.{key}" in msg, msg


def test_the_checkpoint_section_is_declared_once():
    """The config schema's `checkpoint:` is checkpoint/policy.py's SCHEMA (it was two
    tables and a test that they agreed); CheckpointPolicy's defaults are its fields'."""
    from hpctrain.checkpoint.policy import SCHEMA
    from hpctrain.config import SCHEMA as CONFIG_SCHEMA

    assert CONFIG_SCHEMA["checkpoint"] is SCHEMA
    p = CheckpointPolicy({})
    assert (p.keep_last, p.write_timeout, p.resume) == (3, 3600.0, "never")
    assert Config.load(None, []).checkpoint == {k: f.default for k, f in SCHEMA.items()}


def test_due_by_steps_epochs_time_and_final():
    p = CheckpointPolicy({"every_steps": 50, "every_minutes": 10, "at_epoch_end": True})
    t0 = p.last_time
    assert not p.due(10, now=t0 + 1)
    assert p.due(50, now=t0 + 1)
    assert p.due(51, epoch_end=True, now=t0 + 1)
    assert p.due(52, now=t0 + 601)  # ten minutes since the last save
    p.mark_saved(52, now=t0 + 601)
    assert not p.due(52, final=True, now=t0 + 601), "never twice for the same step"
    assert not p.due(53, now=t0 + 700)
    assert p.due(53, final=True, now=t0 + 700)
    off = CheckpointPolicy({"enabled": False})
    assert not off.due(100, epoch_end=True, final=True)
    only_steps = CheckpointPolicy({"every_minutes": None, "at_epoch_end": False, "every_steps": 7})
    assert [s for s in range(1, 30) if only_steps.due(s, epoch_end=True, now=1e9)] == [
        7,
        14,
        21,
        28,
    ]


def test_every_steps_auto_measures_first_then_follows_young_daly():
    from hpctrain.checkpoint.policy import AUTO_FIRST_STEP, young_daly

    # C = 2 s stall, M = 1 h: sqrt(2 x 2 x 3600) = 120 s; at 0.5 s a step, 240 steps
    assert young_daly(2.0, 3600.0, 0.5) == (120.0, 240)
    assert young_daly(0.0, 1.0, 10.0)[1] == 1  # never below one step
    p = CheckpointPolicy({"every_steps": "auto", "mtbf_hours": 1, "every_minutes": None})
    assert (p.auto, p.every_steps, p.mtbf_s) == (True, None, 3600.0)
    first = [s for s in range(1, 60) if p.due(s, now=0.0)]
    assert first[0] == AUTO_FIRST_STEP
    p.mark_saved(AUTO_FIRST_STEP)
    p.every_steps = 240  # what the session sets after measuring that save
    assert not p.due(AUTO_FIRST_STEP + 239, now=0.0)
    assert p.due(AUTO_FIRST_STEP + 240, now=0.0)
    with pytest.raises(ConfigError, match="auto or null"):
        CheckpointPolicy({"every_steps": "often"})
    with pytest.raises(ConfigError, match="mtbf_hours"):
        CheckpointPolicy({"every_steps": "auto", "mtbf_hours": 0})


def test_keep_best_refuses_a_metric_never_recorded_and_the_wrong_end():
    """A typo (val_acc) was accepted and found in no checkpoint, so every "best" one was
    pruned; val_accuracy with the default best_mode min kept the worst."""
    from hpctrain.config import Config

    with pytest.raises(ConfigError, match="'val_acc' is not a metric a run records"):
        Config.load(None, ["checkpoint.keep_best=1", "checkpoint.best_metric=val_acc"])
    CheckpointPolicy({"keep_best": 1, "best_metric": "bleu", "best_mode": "max"})  # a library's
    with pytest.raises(ConfigError, match="best_mode=min would keep the lowest val_accuracy"):
        CheckpointPolicy({"keep_best": 1, "best_metric": "val_accuracy"})
    CheckpointPolicy({"keep_best": 0, "best_metric": "val_accuracy"})  # ranks nothing
    with pytest.raises(ConfigError, match="checkpoint.dir: ' ' is blank"):
        CheckpointPolicy({"dir": " "})
    with pytest.raises(ConfigError, match="checkpoint.resume: '' is blank"):
        CheckpointPolicy({"resume": ""})


def test_retention_keeps_last_k_plus_best():
    p = CheckpointPolicy(
        {"keep_last": 2, "keep_best": 2, "best_metric": "val_accuracy", "best_mode": "max"}
    )
    metrics = [0.1, 0.9, None, 0.8, float("nan"), 0.2, 0.3]
    entries = [Entry(10 * i, Path(f"c{i}"), m) for i, m in enumerate(metrics)]
    kept = {e.path for e in entries} - set(p.to_delete(entries))
    assert sorted(str(k) for k in kept) == ["c1", "c3", "c5", "c6"]  # best 0.9, 0.8; last two
    p_min = CheckpointPolicy({"keep_last": 1, "keep_best": 1, "best_mode": "min"})
    kept = {e.path for e in entries} - set(p_min.to_delete(entries))
    assert sorted(str(k) for k in kept) == ["c0", "c6"]
    assert CheckpointPolicy({"keep_last": None}).to_delete(entries) == []


def test_checkpointer_applies_retention_on_disk_and_after_restart(tmp_path):
    cfg = {"dir": str(tmp_path), "keep_last": 2, "keep_best": 1, "best_metric": "val_loss"}
    ck = Checkpointer(CheckpointPolicy(cfg))
    losses = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.6, 50: 0.7}
    for step, loss in losses.items():
        path = ck.save(step, state(step), {"step": step}, metrics={"val_loss": loss})
        assert path == tmp_path / f"ckpt-{step:08d}.h5"
    assert steps_in(tmp_path) == [20, 40, 50]
    # a restarted job learns the metrics of existing files from the files themselves
    again = Checkpointer(CheckpointPolicy(cfg))
    again.save(60, state(60), metrics={"val_loss": 0.8})
    assert steps_in(tmp_path) == [20, 50, 60]
    assert load(tmp_path / "ckpt-00000020.h5").metrics == {"val_loss": 0.3}


def test_newer_files_from_an_abandoned_timeline_are_left_alone(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step, state(step))
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "keep_last": 1}))
    ck.save(15, state(15))  # resumed from step 10, say
    assert steps_in(tmp_path) == [15, 20, 30]


def test_pruning_leaves_a_file_that_is_only_named_like_a_checkpoint(tmp_path, caplog):
    """keep_last deleted by name: a user's notes saved as ckpt-<step>.h5 went with the
    old checkpoints."""
    (tmp_path / "ckpt-00000005.h5").write_text("notes")
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "keep_last": 1}))
    for step in (10, 20, 30):
        ck.save(step, state(step))
    assert steps_in(tmp_path) == [5, 30]
    assert (tmp_path / "ckpt-00000005.h5").read_text() == "notes"
    assert caplog.text.count("does not begin with hpctrain's checkpoint header") == 1


def test_maybe_save_collects_only_when_due_and_writer_only_writes(tmp_path):
    calls = []

    def collect():
        calls.append(1)
        return {"state": state(5), "trainer_state": {"step": 5}}

    cfg = {"dir": str(tmp_path), "every_steps": 5, "every_minutes": None}
    writer = Checkpointer(CheckpointPolicy(cfg), is_writer=True)
    other = Checkpointer(CheckpointPolicy(cfg), is_writer=False)
    assert not writer.maybe_save(4, collect)
    assert calls == []
    assert writer.maybe_save(4, collect, agree=lambda due: True)  # another rank said yes
    assert other.maybe_save(5, lambda: None)
    assert steps_in(tmp_path) == [4]
    assert writer.maybe_save(5, collect)
    assert not writer.maybe_save(5, collect, epoch_end=True)
    assert steps_in(tmp_path) == [4, 5] and len(calls) == 2


def test_async_save_copies_then_writes_in_background(tmp_path):
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "async": True}))
    st = state(7)
    assert ck.save(7, st, {"step": 7}) is None
    st["model/w"][:] = -1  # training continues and changes the weights at once
    path = ck.wait()
    assert path == tmp_path / "ckpt-00000007.h5"
    assert np.all(load(path).state["model/w"] == 7)
    ck.save(8, state(8))
    ck.save(9, state(9))  # joins the previous write first
    assert ck.wait().name == "ckpt-00000009.h5"
    assert steps_in(tmp_path) == [7, 8, 9]


def test_async_saves_copy_into_buffers_reused_from_the_last_save(tmp_path):
    """The second save copies into the first one's buffers (no fresh pages to fault in);
    the caller's arrays changed after each save never reach either file."""
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "async": True}))
    big = {"model/w": np.full((3, 1 << 20), 1.0, np.float32), "model/b": np.ones(5, np.float32)}
    ck.save(1, big)
    first = {p: a for p, a, _ in ck._thread._args[0].datasets}
    big["model/w"][:] = 2.0  # changes while step 1 is written
    ck.wait()
    ck.save(2, big)
    second = {p: a for p, a, _ in ck._thread._args[0].datasets}
    big["model/w"][:], big["model/b"][:] = 3.0, 3.0
    ck.wait()
    assert second["model/w"] is first["model/w"] and second["model/b"] is first["model/b"]
    assert ck._staging.nbytes == big["model/w"].nbytes + big["model/b"].nbytes
    assert np.all(load(tmp_path / "ckpt-00000001.h5").state["model/w"] == 1.0)
    again = load(tmp_path / "ckpt-00000002.h5").state
    assert np.all(again["model/w"] == 2.0) and np.all(again["model/b"] == 1.0)


def test_a_private_save_keeps_arrays_it_was_handed_and_copies_views(tmp_path):
    """private=True (the loop's export_state copies): an array owning its memory is
    written as handed over; a view into memory the caller keeps is still copied."""
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "async": True}))
    live = np.zeros((4, 8), np.float32)
    handed = {"model/w": np.ones((4, 8), np.float32), "model/v": live[1:3]}
    ck.save(1, handed, private=True)
    written = {p: a for p, a, _ in ck._thread._args[0].datasets}
    live[:] = 5.0  # training changes the live buffer the view looks into
    ck.wait()
    assert written["model/w"] is handed["model/w"] and written["model/v"] is not handed["model/v"]
    assert np.all(load(tmp_path / "ckpt-00000001.h5").state["model/v"] == 0.0)


def test_staging_splits_large_arrays_over_threads_exactly():
    from hpctrain.checkpoint.staging import Staging

    rng = np.random.default_rng(0)
    items = [
        ("a", rng.random((3, 1_500_001), dtype=np.float32)),  # chunks with a ragged tail
        ("b", np.arange(7, dtype=np.int64)),
        ("c", np.array(3.5)),  # 0-d
        ("d", rng.random((9, 4)).T),  # not contiguous: copied whole
    ]
    for threads in (1, 3):
        copies = Staging(threads).stage(items)
        for (_, src), dst in zip(items, copies):
            assert dst.shape == src.shape and dst.dtype == src.dtype
            assert np.array_equal(dst, src) and not np.shares_memory(dst, src)


def test_async_error_surfaces_on_next_call_and_wait(tmp_path, monkeypatch):
    target = tmp_path / "ckpts"
    ck = Checkpointer(CheckpointPolicy({"dir": str(target), "async": True, "every_steps": 1}))
    target.write_text("a file where the directory should be")  # real failure: mkdir fails
    ck.save(1, state(1))
    ck._thread.join()
    with pytest.raises(CheckpointError, match="background save of step 1 failed") as info:
        ck.maybe_save(2, lambda: {"state": state(2)})
    assert "ckpts" in str(info.value)
    target.unlink()
    assert ck.maybe_save(2, lambda: {"state": state(2)})  # reported once, then cleared
    assert ck.wait() == target / "ckpt-00000002.h5"

    def boom(directory, snap, **_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_mod, "write", boom)
    ck.save(3, state(3))
    with pytest.raises(CheckpointError, match=r"step 3 failed: .*No space left"):
        ck.wait()
    assert ck.wait() == target / "ckpt-00000002.h5"


def test_failed_sync_save_leaves_no_temp(tmp_path, monkeypatch):
    def broken_stamp(path, extents=None):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer_mod.fmt, "stamp_header", broken_stamp)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*Input/output error"):
        save(tmp_path, 3, state(3))
    assert list(tmp_path.iterdir()) == []


def test_resume_choices(tmp_path):
    assert resume_checkpoint(CheckpointPolicy({"dir": str(tmp_path), "resume": "auto"})) is None
    save(tmp_path, 10, state(10))
    save(tmp_path, 20, state(20))
    assert resume_checkpoint(CheckpointPolicy({"dir": str(tmp_path), "resume": "auto"})).step == 20
    assert resume_checkpoint(CheckpointPolicy({"dir": str(tmp_path), "resume": "never"})) is None
    one = str(tmp_path / "ckpt-00000010.h5")
    assert resume_checkpoint(CheckpointPolicy({"resume": one})).step == 10
    shutil.copy(tmp_path / "ckpt-00000010.h5", tmp_path / "x.h5")
    with open(tmp_path / "x.h5", "r+b") as fh:
        fh.seek(-10, 2)
        fh.write(b"XXXX")
    with pytest.raises(CheckpointError, match="x.h5: file digest mismatch"):
        resume_checkpoint(CheckpointPolicy({"resume": str(tmp_path / "x.h5")}))
    # auto with checkpoints none of which verifies: refused (a fresh start would write
    # over them), the files left as they were
    auto = CheckpointPolicy({"dir": str(tmp_path), "resume": "auto"}, run_dir=tmp_path)
    newest = tmp_path / "ckpt-00000020.h5"
    newest.write_bytes(b"damaged")
    (tmp_path / "ckpt-00000010.h5").rename(tmp_path / "good")
    (tmp_path / "ckpt-00000010.h5").write_bytes(b"damaged too")
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoint\(s\) .* verifies"):
        resume_checkpoint(auto)
    assert newest.read_bytes() == b"damaged"


def test_auto_past_a_damaged_newest_sets_it_aside(tmp_path, caplog):
    """The newest damaged beside a good one: the good one, and the newer files (a sharded
    checkpoint whose shard folder was lost, a shard folder without its commit) move to
    <run-dir>/previous/<UTC>/, where this run's own save of their step cannot replace
    them."""
    import logging

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    save(ckpts, 10, state(10))
    (ckpts / "ckpt-00000020.h5").write_bytes(b"damaged")
    (ckpts / "ckpt-00000030.shards").mkdir()
    (ckpts / "ckpt-00000030.shards" / "shard.h5").write_bytes(b"a rank's part")
    (ckpts / "notes.txt").write_text("the user's")
    auto = CheckpointPolicy({"resume": "auto"}, run_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        assert resume_checkpoint(auto).step == 10
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-00000010.h5", "notes.txt"]
    (aside,) = (tmp_path / "previous").iterdir()
    assert (aside / "ckpt-00000020.h5").read_bytes() == b"damaged"
    assert (aside / "ckpt-00000030.shards" / "shard.h5").read_bytes() == b"a rank's part"
    assert "resuming from step 10; the 2 newer file(s) that do not verify" in caplog.text
    assert resume_checkpoint(auto).step == 10  # nothing newer: nothing moves
    assert len(list((tmp_path / "previous").iterdir())) == 1


def test_a_resume_says_which_compressor_state_starts_afresh(caplog):
    """Same world size, other compression settings (compression.rank 2 -> 4): PowerSGD's
    factors cannot be taken back and start afresh; said once, by name, with the sizes."""
    import logging

    import numpy as np

    from hpctrain.checkpoint.session import _say_what_starts_afresh

    saved = {"residual": np.zeros(100), "powersgd.q": np.zeros(20)}
    current = {"residual": np.zeros(100), "powersgd.q": np.zeros(40)}
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        _say_what_starts_afresh("ckpt-00000020.h5", current, saved)
        _say_what_starts_afresh("ckpt-00000020.h5", current, current)  # all taken: silent
    assert [r.getMessage() for r in caplog.records] == [
        "ckpt-00000020.h5: saved with other compression settings, so these start afresh: "
        "powersgd.q (20 vs 40 values)"
    ]
