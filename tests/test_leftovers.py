"""Leftovers of issue 29 (item 9): a refused run leaves no empty run directory behind, and
an unset $VAR in data.path is named as such, not reported as a missing file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mpirun import HPCTRAIN, ROOT

from hpctrain import rundir
from hpctrain.data import expand_path
from hpctrain.errors import DataError

UNSET = "HPCTRAIN_TEST_UNSET_DIR"


# --- $VARS in data.path -----------------------------------------------------------------
@pytest.mark.parametrize("text", [f"${UNSET}/train.h5", f"${{{UNSET}}}/train.h5"])
def test_an_unset_variable_is_named(text):
    with pytest.raises(DataError) as err:
        expand_path(text, "data.path", env={"HOME": "/root"})
    message = str(err.value)
    assert f"${UNSET} is not set" in message and "data.path" in message, message
    assert "not found" not in message and "\n" not in message


def test_set_variables_expand_and_a_literal_dollar_that_exists_is_kept(tmp_path):
    env = {"NODE_TMP": str(tmp_path)}
    assert expand_path("$NODE_TMP/train.h5", "data.path", env) == tmp_path / "train.h5"
    assert expand_path("${NODE_TMP}/x.h5", "data.path", env) == tmp_path / "x.h5"
    odd = tmp_path / "a$b.h5"  # a file whose name has a dollar in it
    odd.write_bytes(b"")
    assert expand_path(str(odd), "data.path", env) == odd
    # a leading ~, as a shell reads it (reported "not found" for a file that exists)
    assert expand_path("~/train.h5", "data.path", env) == Path.home() / "train.h5"


# --- the run directory of a refused run -------------------------------------------------
def test_only_the_directories_it_created_and_only_empty_ones_go(tmp_path):
    run = tmp_path / "a" / "b" / "run"
    rundir.make_run_dir(run)
    (run / "checkpoints").mkdir()  # an empty directory made before the refusal
    assert set(rundir.remove_unused_run_dir()) == {
        run / "checkpoints",
        run,
        run.parent,
        run.parent.parent,
    }
    assert not (tmp_path / "a").exists() and tmp_path.is_dir()

    rundir.make_run_dir(run)
    (run / "data").mkdir()
    (run / "data" / "cache.h5").write_bytes(b"x")  # a file: kept, and everything above it
    assert rundir.remove_unused_run_dir() == []
    assert (run / "data" / "cache.h5").exists()

    existing = tmp_path / "mine"
    existing.mkdir()
    rundir.make_run_dir(existing)  # not created by the run: never removed
    assert rundir.remove_unused_run_dir() == [] and existing.is_dir()


def test_the_synthetic_cache_a_refused_run_wrote_into_its_new_directory_goes(tmp_path):
    """The data cache (data/synthetic-*.h5) of a run refused after writing it (a model
    too big for its ranks) goes with the directory this run created; in a directory that
    was there before, it stays (an earlier run's, reused by the next)."""
    run = tmp_path / "new"
    rundir.make_run_dir(run)
    (run / "data").mkdir()
    cache = run / "data" / "synthetic-vectors-n64-16-s1-f32-c10.h5"
    cache.write_bytes(b"x")
    assert set(rundir.remove_unused_run_dir()) == {cache, run / "data", run}
    assert not run.exists()
    old = tmp_path / "old"
    (old / "data").mkdir(parents=True)
    kept = old / "data" / cache.name
    kept.write_bytes(b"x")
    rundir.make_run_dir(old)
    assert rundir.remove_unused_run_dir() == [] and kept.exists()


def _train(*args: str):
    env = {k: v for k, v in os.environ.items() if k != UNSET}
    proc = subprocess.run(
        [HPCTRAIN, "train", *args], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "path,message",
    [
        (f"${UNSET}/train.h5", f"${UNSET} is not set"),
        ("/nonexistent-hpctrain/train.h5", "/nonexistent-hpctrain/train.h5"),
    ],
    ids=["unset-variable", "missing-file"],
)
def test_a_refused_run_leaves_no_run_directory(tmp_path, path, message):
    run = tmp_path / "runs" / "refused"
    rc, out = _train(
        "--run-dir", str(run), "--set", "data.source=hdf5", "--set", f"data.path={path}"
    )
    assert rc == 2, out
    assert message in out and "Traceback" not in out, out
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in tmp_path.rglob("*"))
