"""Sharded checkpoints in one process: the cut covers every element once, the commit
file and its shard files verify and load whole, and damage to any shard is named.
(Written by real ranks: test_zero_jobs, test_resume_jobs, test_multinode.)"""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.checkpoint import (
    Checkpointer,
    CheckpointPolicy,
    find_latest_valid,
    load,
    sharded,
    verify,
    writer,
)
from hpctrain.checkpoint import format as fmt
from hpctrain.errors import CheckpointError
from hpctrain.exchange.zero import ZeroPartition
from hpctrain.tensor import parallel as tensor_parallel


def _state(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model/a.weight": rng.standard_normal((300, 70)).astype(np.float32),
        "model/a.bias": rng.standard_normal(70).astype(np.float32),
        "model/empty": np.zeros((0, 4), np.float32),
        "model/b.weight": rng.standard_normal((33, 17)).astype(np.float64),
        "optimizer/momentum_buffer/a.weight": rng.standard_normal((300, 70)).astype(np.float32),
        "optimizer/step": np.array(7, np.int64),
    }


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("min_bytes", [1, 10_000, 1 << 30])
def test_split_covers_every_element_exactly_once(size, min_bytes):
    state = _state()
    seen = {k: np.zeros(v.size, int) for k, v in state.items()}
    per_rank = []
    for rank in range(size):
        pieces = sharded.split_replicated(state, rank, size, min_bytes)
        per_rank.append(sum(p[2].nbytes for p in pieces.values()))
        for name, (shape, start, arr) in pieces.items():
            assert tuple(shape) == state[name].shape
            np.testing.assert_array_equal(arr, state[name].reshape(-1)[start : start + arr.size])
            seen[name][start : start + arr.size] += 1
    for name, counts in seen.items():
        assert (counts == 1).all(), name
    total = sum(v.nbytes for v in state.values())
    writers = sharded.writer_ranks(total, size, min_bytes)
    assert len(writers) == max(1, min(size, total // min_bytes))
    busy = [b for b in per_rank if b]
    assert len(busy) == len(writers)
    assert max(busy) - min(busy) <= 2 * 300 * 70 * 4 / len(writers) + 8  # balanced by bytes


def test_writers_are_spread_over_the_ranks():
    assert sharded.writer_ranks(4 << 20, 16) == [0, 4, 8, 12]
    assert sharded.writer_ranks(300 << 20, 4096)[:3] == [0, 13, 27]


def _fake_comm(rank, size):
    return SimpleNamespace(rank=rank, size=size)


@pytest.mark.parametrize("stage,bucket", [(1, 0), (2, 256), (2, 4000)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_zero_owned_pieces_cover_every_parameter_once(stage, bucket, size):
    shapes = [(10, 7), (5,), (0,), (33,), (4, 4, 3)]
    sizes = [int(np.prod(s)) for s in shapes]
    names = [f"optimizer/exp_avg/p{i}" for i in range(len(shapes))]
    full = [np.arange(n, dtype=np.float32) + 1000 * i for i, n in enumerate(sizes)]
    seen = [np.zeros(n, int) for n in sizes]
    covered = set()
    for rank in range(size):
        part = ZeroPartition(_fake_comm(rank, size), sizes, stage, bucket)
        shard = part.shard_of(part.flatten(full))
        for name, (shape, start, arr) in part.owned_pieces(shard, names, shapes).items():
            i = names.index(name)
            assert shape == shapes[i]
            np.testing.assert_array_equal(arr, full[i][start : start + arr.size])
            seen[i][start : start + arr.size] += 1
            covered.add(name)
    assert all((s == 1).all() for s in seen)
    assert covered == set(names)  # the empty parameter too (rank 0's)


def _write_sharded(directory, step, state, size, min_bytes=1, trainer=None):
    """What the ranks of a sharded save do, one after another in this process."""
    records = [
        sharded.write_shard(
            directory, step, r, size, sharded.split_replicated(state, r, size, min_bytes)
        )
        for r in range(size)
    ]
    policy = CheckpointPolicy({"keep_last": 2}, directory)
    policy.dir = directory
    ckpt = Checkpointer(policy)
    trainer = trainer or {"step": step, "epoch": 0, "position": 0}
    return ckpt.save(
        step, {}, trainer, {0: {"x": np.arange(3)}}, shards=sharded.shard_table(records)
    )


def test_sharded_checkpoint_loads_whole_and_verifies(tmp_path):
    state = _state()
    path = _write_sharded(tmp_path, 10, state, 3)
    assert path == tmp_path / "ckpt-00000010.h5"
    folder = tmp_path / "ckpt-00000010.shards"
    assert sorted(os.listdir(folder)) == [fmt.shard_name(r, 3) for r in range(3)]
    ckpt = load(path)
    assert list(ckpt.state) == list(state)  # the model's order is kept
    for k, v in state.items():
        assert ckpt.state[k].dtype == v.dtype and ckpt.state[k].shape == v.shape
        np.testing.assert_array_equal(ckpt.state[k], v)
    assert ckpt.trainer["step"] == 10 and ckpt.attrs["shards"] == 3
    assert verify(path).nbytes >= sum(v.nbytes for v in state.values())
    assert find_latest_valid(tmp_path).step == 10


def test_cli_verifies_and_inspects_a_sharded_checkpoint(tmp_path, capsys):
    from hpctrain.cli import main as cli_main

    path = _write_sharded(tmp_path, 10, _state(), 2)
    assert cli_main(["ckpt", "verify", str(path)]) == 0
    assert cli_main(["ckpt", "inspect", str(path), "--no-config"]) == 0
    out = capsys.readouterr().out
    assert "2 files in" in out and "model/a.weight" in out and "(300, 70)" in out
    (tmp_path / "ckpt-00000010.shards" / fmt.shard_name(1, 2)).unlink()
    assert cli_main(["ckpt", "verify", str(path)]) == 1
    assert "shard-00001-of-00002.h5 is missing" in capsys.readouterr().out


def test_damaged_missing_or_replaced_shards_are_named(tmp_path):
    state = _state()
    path = _write_sharded(tmp_path, 10, state, 3)
    shard = tmp_path / "ckpt-00000010.shards" / fmt.shard_name(1, 3)
    saved = shard.read_bytes()
    data = bytearray(saved)
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard-00001-of-00003\.h5.*digest mismatch"):
        load(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard-00001-of-00003.h5 is missing"):
        verify(path)
    # a complete, valid shard file of another save under the same name
    other = tmp_path / "other"
    _write_sharded(other, 10, _state(seed=1), 3)
    shutil.copy(other / "ckpt-00000010.shards" / fmt.shard_name(1, 3), shard)
    with pytest.raises(CheckpointError, match="not the one this checkpoint committed"):
        load(path)
    shard.write_bytes(saved)
    assert load(path).step == 10
    # an older valid checkpoint is what `auto` resumes from when the newest is damaged
    _write_sharded(tmp_path, 20, state, 2)
    (tmp_path / "ckpt-00000020.shards" / fmt.shard_name(0, 2)).unlink()
    assert find_latest_valid(tmp_path).step == 10


def test_rank_state_files_are_read_by_their_rank_and_verified(tmp_path):
    """Each rank's private arrays (error-feedback residuals) in a file of its own: a load
    reads none of them, a rank reads its own against the committed digest, `verify`
    checks them all (a resume with a damaged one starts the residuals from zero:
    test_resume_jobs)."""
    from hpctrain.checkpoint.reader import read_rank_state

    residual = [np.full(1000, r + 0.5, np.float32) for r in range(2)]

    def save(step):
        ranks = [
            sharded.write_rank_state(tmp_path, step, r, 2, {"residual": residual[r]})
            for r in range(2)
        ]
        policy = CheckpointPolicy({"keep_last": None}, tmp_path)
        policy.dir = tmp_path
        trainer = {"step": step, "epoch": 0, "position": 0}
        table = {"order": [], "files": [], "rank_state": ranks}
        return Checkpointer(policy).save(step, dict(_state()), trainer, shards=table)

    path = save(20)
    ckpt = load(path)
    assert sorted(r["rank"] for r in ckpt.rank_files) == [0, 1]
    for r in range(2):
        np.testing.assert_array_equal(read_rank_state(ckpt, r)["residual"], residual[r])
    assert read_rank_state(ckpt, 2) is None
    assert verify(path).nbytes >= sum(a.nbytes for a in residual)
    damaged = tmp_path / "ckpt-00000020.shards" / fmt.rank_state_name(1, 2)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-state-00001-of-00002\.h5.*digest mismatch"):
        read_rank_state(load(path), 1)
    with pytest.raises(CheckpointError, match="rank-state-00001-of-00002.h5"):
        verify(path)
    damaged.unlink()
    with pytest.raises(CheckpointError, match="rank-state-00001-of-00002.h5 is missing"):
        read_rank_state(load(path), 1)


def test_commit_table_is_covered_by_the_commit_digest(tmp_path):
    path = _write_sharded(tmp_path, 10, _state(), 2)
    raw = bytearray(path.read_bytes())
    at = raw.find(b'"pieces"')
    assert at > 0
    raw[at + 1] = ord("P")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="ckpt-00000010.h5"):
        load(path)


def test_retention_removes_shards_and_orphans(tmp_path):
    state = _state()
    for step in (10, 20):
        _write_sharded(tmp_path, step, state, 2)
    # a save of step 25 that crashed before its commit: shard files, no commit
    sharded.write_shard(tmp_path, 25, 0, 2, sharded.split_replicated(state, 0, 2, 1))
    _write_sharded(tmp_path, 30, state, 2)  # keep_last 2: step 10 goes, with its shards
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "ckpt-00000020.h5",
        "ckpt-00000020.shards",
        "ckpt-00000030.h5",
        "ckpt-00000030.shards",
    ]


def test_retention_keeps_a_users_file_in_a_shard_folder(tmp_path, caplog):
    """Pruning removed a shard folder whole, a user's file in it with it."""
    state = _state()
    _write_sharded(tmp_path, 10, state, 2)
    (tmp_path / "ckpt-00000010.shards" / "notes.txt").write_text("mine")
    sharded.write_shard(tmp_path, 15, 1, 2, sharded.split_replicated(state, 1, 2, 1))
    (tmp_path / "ckpt-00000015.shards" / "copy.h5").write_text("mine")  # an orphan's
    for step in (20, 30, 40):
        _write_sharded(tmp_path, step, state, 2)
    assert sorted(os.listdir(tmp_path / "ckpt-00000010.shards")) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path / "ckpt-00000015.shards")) == ["copy.h5"]
    assert not (tmp_path / "ckpt-00000010.h5").exists()
    assert "ckpt-00000010.shards" in caplog.text and "notes.txt" in caplog.text
    assert caplog.text.count("copy.h5") == 1  # once, not at every save


def test_shard_pieces_outside_the_tensor_are_refused(tmp_path):
    bad = {"model/w": ((4,), 2, np.zeros(3, np.float32))}
    with pytest.raises(CheckpointError, match="outside"):
        sharded.write_shard(tmp_path, 1, 0, 1, bad)
    with pytest.raises(CheckpointError, match="not a model/ or optimizer/"):
        sharded.write_shard(tmp_path, 1, 0, 1, {"rng/x": ((1,), 0, np.zeros(1))})


def test_header_digest_from_memory_equals_reading_the_file(tmp_path):
    """The save hashes the raw data from memory (HDF5's offsets); the digest must be the
    one a full read of the file gives, for every kind of dataset."""
    rng = np.random.default_rng(3)
    state = {
        "model/f32": rng.standard_normal((64, 33)).astype(np.float32),
        "model/f16": rng.standard_normal(1001).astype(np.float16),
        "model/c64": (rng.standard_normal(17) + 1j).astype(np.complex64),
        "model/b": rng.standard_normal(9) > 0,
        "model/u8": rng.integers(0, 255, 4097, dtype=np.uint8),
        "model/big_endian": rng.standard_normal(31).astype(">f8"),
        "model/scalar": np.array(3.5),
        "model/empty": np.zeros((0,), np.int32),
        "optimizer/step": np.array(7, np.int64),
    }
    path = writer.save(tmp_path, 5, state, {"step": 5, "note": "x"})
    with open(path, "rb") as fh:
        header = fh.read(fmt.HEADER_SIZE)
        length = os.fstat(fh.fileno()).st_size
        full = fmt._hash_file_tail(fh, length)
    assert full.encode() in header
    assert verify(path).step == 5
    table = json.loads(np.asarray(__import__("h5py").File(path)["manifest"]).tobytes())
    assert "shards" not in table


def _commit(directory, step, records):
    policy = CheckpointPolicy({"keep_last": None}, directory)
    policy.dir = directory
    trainer = {"step": step, "epoch": 0, "position": 0}
    return Checkpointer(policy).save(step, {}, trainer, shards=sharded.shard_table(records))


def test_tensor_parallel_slices_are_joined_into_canonical_tensors(tmp_path):
    # q, k and v rows split by heads (3 row blocks per rank), a column split and a row
    # split: each tensor rank writes its own slices; load joins them with unshard.
    rng = np.random.default_rng(0)
    full = {
        "model/blocks.0.attn.qkv.weight": rng.standard_normal((12, 4)).astype(np.float32),
        "model/blocks.0.attn.proj.weight": rng.standard_normal((4, 6)).astype(np.float32),
        "optimizer/momentum/blocks.0.ffn.fc1.weight": rng.standard_normal((8, 4)),
    }
    records = []
    for r in range(2):
        pieces = {
            k: (v.shape, ("tensor", r, 2), tensor_parallel.shard(k.rsplit("/", 1)[-1], v, 2, r))
            for k, v in full.items()
        }
        records.append(sharded.write_shard(tmp_path, 5, r, 2, pieces))
    path = _commit(tmp_path, 5, records)
    state = load(path).state
    for k, v in full.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    assert verify(path).step == 5
    # rank 1's slices missing from the table: named, not silently half a tensor
    (tmp_path / "ckpt-00000005.h5").unlink()
    path = _commit(tmp_path, 5, records[:1])
    with pytest.raises(CheckpointError, match="do not cover /model/blocks.0.attn"):
        load(path)


def test_ranges_of_tensor_slices_are_joined_and_must_tile_each_slice(tmp_path):
    # ZeRO x tensor parallelism: 2 data ranks own halves of each tensor rank's slice
    # of an optimizer slot, written as ("tensor", t, 2, first) by the 4 ranks.
    rng = np.random.default_rng(1)
    name = "optimizer/exp_avg/blocks.0.attn.qkv.weight"
    full = rng.standard_normal((12, 4)).astype(np.float32)
    pieces = []
    for t in range(2):
        flat = tensor_parallel.shard("attn.qkv.weight", full, 2, t).reshape(-1)
        half = flat.size // 2
        pieces += [
            {name: (full.shape, ("tensor", t, 2, d * half), flat[d * half : (d + 1) * half])}
            for d in range(2)
        ]
    records = [sharded.write_shard(tmp_path, 5, r, 4, p) for r, p in enumerate(pieces)]
    path = _commit(tmp_path, 5, records)
    np.testing.assert_array_equal(load(path).state[name], full)
    # tensor rank 1's second half missing: its slice is not covered, named
    (tmp_path / "ckpt-00000005.h5").unlink()
    path = _commit(tmp_path, 5, records[:3])
    with pytest.raises(CheckpointError, match="do not cover /optimizer/exp_avg/blocks.0.attn"):
        load(path)
    # a range past the end of its slice is refused when written
    with pytest.raises(CheckpointError, match="not a 1/2 slice"):
        sharded.write_shard(tmp_path, 6, 0, 1, {name: (full.shape, ("tensor", 0, 2, 22), full[0])})


def test_flat_pieces_must_tile_the_tensor_not_just_add_up(tmp_path):
    # two copies of the first half: as many elements as the tensor, half of it missing
    a = np.arange(10, dtype=np.float32)
    first = {"model/a": ((10,), 0, a[:5])}
    records = [sharded.write_shard(tmp_path, 3, r, 2, first) for r in range(2)]
    path = _commit(tmp_path, 3, records)
    with pytest.raises(CheckpointError, match="do not cover /model/a exactly"):
        load(path)


def test_the_reserved_bytes_cover_a_commit_with_a_large_shard_table(tmp_path):
    # 4,096 writers' records: the commit's manifest is MBs, all inside the reservation
    # (HDF5 must never write past it, where a full disk would meet it mid-file).
    record = {"file": "", "digest": "0" * 32, "bytes": 1, "pieces": {}}
    files = [
        {**record, "file": fmt.shard_name(r, 4096), "pieces": {f"model/w{r}": ["<f4", [9], 0, 9]}}
        for r in range(4096)
    ]
    table = {"order": [f"model/w{r}" for r in range(4096)], "files": files}
    snap = writer.snapshot(3, {}, {"step": 3}, shards=table)
    path = writer.write(tmp_path, snap)
    assert path.stat().st_size <= writer.estimated_bytes(snap)
    assert path.stat().st_size > 512 * 1024  # the table is what makes it big


def test_a_shard_file_is_not_taken_for_a_checkpoint(tmp_path):
    """A file picked out of ckpt-<step>.shards/ verified, exported flattened tensors and
    was resumed into a shape mismatch: it is refused, pointing at its commit file."""
    commit = _write_sharded(tmp_path, 5, _state(), 2)
    assert verify(commit).step == 5
    shard = tmp_path / fmt.shards_dir_name(5) / fmt.shard_name(1, 2)
    expected = (
        f"{shard} is rank 1's shard file of the sharded checkpoint of step 5, not a "
        "checkpoint: pass its commit file, ckpt-00000005.h5"
    )
    for read in (verify, load):
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            read(shard)
