"""Full disks never crash or corrupt: the synthetic data set, the metrics log and checkpoints on a
small tmpfs (mounted and unmounted here; needs root), under real mpirun."""

import contextlib
import json
import os
import re
import subprocess

import numpy as np
import pytest
from mpirun import HPCTRAIN, mpirun

from hpctrain.checkpoint import list_checkpoints, sharded, verify, writer
from hpctrain.data import synthetic
from hpctrain.errors import CheckpointError, DataError
from hpctrain.rundir import CHECKPOINT_OWNER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

SMALL = ["train.epochs=1", "model.hidden=[16]", "checkpoint.enabled=false"]


@contextlib.contextmanager
def tmpfs(path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _train(np_, run_dir, *overrides, timeout=240):
    args = [HPCTRAIN, "train", "--run-dir", str(run_dir)]
    for o in [*SMALL, *overrides]:
        args += ["--set", o]
    return mpirun(np_, *args, timeout=timeout)


def test_a_synthetic_data_set_too_big_for_the_disk_is_refused_on_every_rank(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        job = _train(2, disk / "run", "data.train_samples=20000", "data.features=32")
        assert job.returncode == 2, job.output  # an agreed error, not a crash (139/-11)
        assert "Segmentation fault" not in job.output and "Traceback" not in job.output
        assert "cannot write synthetic dataset" in job.output, job.output
        assert f"no space left on the disk of {disk / 'run' / 'data'}" in job.output
        assert "MiB free" in job.output and "needed" in job.output
        data = disk / "run" / "data"
        assert not data.exists() or not list(data.iterdir())  # no file to mistake for data


def test_a_disk_that_fills_while_writing_the_data_set_leaves_no_file(tmp_path, monkeypatch):
    # The free-space check passes (as when another job fills the disk meanwhile): the
    # write itself meets ENOSPC, where HDF5 used to crash with a segmentation fault.
    monkeypatch.setattr(synthetic.diskspace, "check_room", lambda path, need: None)
    splits, attrs = synthetic.generate("vectors", 20000, 100, 0)
    with tmpfs(tmp_path / "disk", "2m") as disk:
        with pytest.raises(DataError, match=r"no space left on the disk of .*x\.h5 \(\d"):
            synthetic.write_dataset(disk / "data" / "x.h5", splits, attrs)
        assert list((disk / "data").iterdir()) == []


def test_metrics_on_a_full_disk_stop_the_job_with_one_line_and_whole_lines(tmp_path):
    # The data set lives elsewhere; the run directory's disk fills while metrics grow.
    data = synthetic.write_dataset(
        tmp_path / "data.h5", *synthetic.generate("vectors", 4096, 256, 0)
    )
    with tmpfs(tmp_path / "disk", "64k") as disk:
        run = disk / "run"
        run.mkdir()
        (disk / "filler").write_bytes(b"0" * (64 * 1024 - 3 * 4096 - 100))  # ~2 pages left
        job = _train(
            2,
            run,
            "data.source=hdf5",
            f"data.path={data}",
            "train.batch_size=8",
            "train.log_every=1",
            "train.epochs=3",
            "metrics.tensorboard=false",
        )
        assert job.returncode != 0 and job.returncode not in (139, -11), job.output
        assert "Traceback" not in job.output, job.output
        assert f"metrics: cannot write {run / 'metrics.jsonl'}: no space left on the disk" in (
            job.output
        )
        assert job.output.count("metrics: cannot write") == 1
        lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b""  # ends with a whole line
        records = [json.loads(x) for x in lines[:-1]]
        assert len(records) > 5 and all("event" in r for r in records)


def test_a_partial_last_line_left_by_a_crash_is_dropped_on_reopen(tmp_path):
    from hpctrain.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "step": 1}\n{"event": "st')
    w = MetricsWriter(tmp_path, True, tensorboard=False)
    w.write("step", step=2)
    w.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def test_a_sharded_checkpoint_on_a_full_disk_stops_every_rank_and_keeps_the_last(tmp_path):
    # Each rank writes its shard to a tmpfs that holds two checkpoints: the third save
    # meets the full disk on the ranks, every rank stops with the path and the free
    # space, and the two committed checkpoints still verify (no temp or orphan left).
    data = synthetic.write_dataset(
        tmp_path / "data.h5", *synthetic.generate("vectors", 1024, 128, 0, features=64)
    )
    with tmpfs(tmp_path / "disk", "9m") as disk:  # a checkpoint: 3.6 MB
        job = _train(
            2,
            tmp_path / "run",
            "data.source=hdf5",
            f"data.path={data}",
            "train.batch_size=16",
            "train.epochs=4",
            "model.hidden=[512,512]",
            "optimizer.name=adam",
            "metrics.tensorboard=false",
            "checkpoint.enabled=true",
            f"checkpoint.dir={disk}",
            "checkpoint.every_steps=8",
            "checkpoint.keep_last=null",
            "checkpoint.shard_min_mb=0.001",
        )
        assert job.returncode == 2, job.output  # agreed, not a crash
        assert "Traceback" not in job.output and "Segmentation fault" not in job.output
        assert f"no space left on the disk of {disk}" in job.output, job.output
        assert re.search(r"\(\d[\d.]* (B|KiB|MiB) free, 1\.\d MiB needed\)", job.output)
        commits = [path for _, path in list_checkpoints(disk)]
        assert len(commits) >= 1, sorted(p.name for p in disk.iterdir())
        for path in commits:
            assert verify(path).step > 0
            assert len(list(sharded.shards_dir(path).glob("shard-*.h5"))) == 2
        names = {p.name for p in disk.iterdir()} - {CHECKPOINT_OWNER}  # the run's, in it
        assert names == {p.name for p in commits} | {sharded.shards_dir(p).name for p in commits}, (
            names
        )  # the failed save's files are gone
        assert not [p for p in disk.rglob("*") if ".tmp" in p.name]


def test_a_checkpoint_meeting_a_full_disk_midway_is_refused_before_hdf5_writes(
    tmp_path, monkeypatch
):
    # The free-space check passes (another job fills the disk meanwhile): the blocks
    # reserved before HDF5 writes meet ENOSPC as a plain error, not as HDF5 crashing.
    monkeypatch.setattr(writer.diskspace, "check_room", lambda path, need: None)
    state = {f"model/w{i}": np.ones(100_000, np.float32) for i in range(8)}  # 3.2 MB
    with tmpfs(tmp_path / "disk", "2m") as disk:
        with pytest.raises(CheckpointError, match=r"no space left on the disk of .*MiB needed"):
            writer.save(disk, 7, state)
        assert list(disk.iterdir()) == []
