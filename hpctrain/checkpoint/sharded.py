"""Sharded checkpoints: every rank writes what it holds, in parallel; a small file commits.

    checkpoints/ckpt-00000120.h5                               the commit (rank 0, last)
    checkpoints/ckpt-00000120.shards/shard-00003-of-00004.h5   rank 3's pieces

A piece is a flat element range of a canonical tensor (`model/<name>`,
`optimizer/<slot>/<name>`): replicated tensors are cut so that each writer holds about
1/W of their bytes, and a ZeRO rank writes the optimizer state it alone owns. A
tensor-parallel rank's slice of a split tensor (not one flat range: a column slice, or
q, k and v rows) is a piece of its own kind, ("tensor", rank, T), joined at load with
tensor/parallel.py's `unshard`, so no rank gathers the whole model to save it; under
ZeRO with tensor parallelism a rank owns a flat range of its slice's optimizer state,
("tensor", rank, T, first). Each shard
file is an ordinary hpctrain checkpoint file (header digest, manifest, per-dataset
digests). The commit file holds the trainer state, every rank's random state and the
shard table (each file's name, whole-file digest and pieces), so a shard replaced, lost
or damaged after the commit is named at load. Nothing is a checkpoint until the commit is
renamed into place (like torch.distributed.checkpoint's and Orbax's metadata file): a
crash mid-save leaves the previous checkpoint the newest, and the orphaned shard
directory is removed by a later save. Loading (reader.py) joins the pieces into whole
canonical tensors, so a sharded checkpoint resumes at any world size and in any strategy.

Scale: replicated state goes to W = min(N, bytes / 1 MiB) writers spread over the ranks
(a 300 MB model: 300 files of 1 MB at 1,024 or 4,096 ranks, not thousands of tiny ones),
so its pieces total (tensors + W). ZeRO-1 state adds N pieces (one flat range per rank),
ZeRO-2 N per gradient bucket. Rank 0 gathers one record per writer, ~80 bytes per piece:
a 300-tensor model at 4,096 ranks under ZeRO-1 is ~0.4 MB once per save, plus N random
states as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..runtime.faults import NO_FAULTS, Faults
from ..tensor import parallel as tensor_parallel
from ..version import __version__
from . import format as fmt
from . import writer

log = logging.getLogger(__name__)

MIN_SHARD_BYTES = 1 << 20  # replicated state is not cut into files smaller than this

# canonical name -> (whole tensor's shape, first flat element or ("tensor", rank, T) or
# ("tensor", rank, T, first flat element of the slice), 1-D elements)
Pieces = dict[str, tuple[tuple[int, ...], int | tuple[str, int, int], np.ndarray]]


def writer_ranks(total_bytes: int, size: int, min_bytes: int = MIN_SHARD_BYTES) -> list[int]:
    """The ranks that write replicated state: spread evenly, so no node gets them all."""
    writers = max(1, min(size, total_bytes // max(1, min_bytes)))
    return [j * size // writers for j in range(writers)]


def split_replicated(
    state: dict[str, np.ndarray], rank: int, size: int, min_bytes: int = MIN_SHARD_BYTES
) -> Pieces:
    """This rank's part of a state every rank holds whole: a contiguous 1/W of its bytes.

    An element goes to the writer whose byte range holds its first byte, so the writers'
    pieces cover every element exactly once, in the state's order. A tensor without
    elements goes to the writer at its position (its shape must still be recorded).
    """
    arrays = {k: np.asarray(v) for k, v in state.items()}
    total = sum(a.nbytes for a in arrays.values())
    ranks = writer_ranks(total, size, min_bytes)
    pieces: Pieces = {}
    j, w = (ranks.index(rank), len(ranks)) if rank in ranks else (0, 0)
    lo, hi = (total * j // w, total * (j + 1) // w) if w else (0, 0)
    pos = 0
    for name, a in arrays.items():
        item = a.itemsize
        first = max(0, -(-(lo - pos) // item))
        last = min(a.size, max(0, -(-(hi - pos) // item)))
        empty_here = a.size == 0 and w and (lo <= pos < hi or (pos == total and j == w - 1))
        if last > first or empty_here:
            pieces[name] = (a.shape, first, a.reshape(-1)[first:last])
        pos += a.nbytes
    return pieces


def write_shard(
    directory: str | Path,
    step: int,
    rank: int,
    size: int,
    pieces: Pieces,
    faults: Faults = NO_FAULTS,
):
    """Write this rank's pieces as its shard file (atomically); return its record for the
    commit's table, or None when the rank holds nothing to write."""
    if not pieces:
        return None
    datasets, table = [], {}
    for name, (shape, start, arr) in pieces.items():
        if not name.startswith(writer.STATE_PREFIXES):
            raise CheckpointError(f"shard piece {name!r}: not a model/ or optimizer/ tensor")
        writer._check_path("shard piece", name)
        arr = fmt.check_array(f"shard piece {name!r}", np.ascontiguousarray(arr).reshape(-1))
        count = int(np.prod(shape, dtype=np.int64))
        if isinstance(start, tuple):  # ("tensor", rank, T[, first]): a tensor-parallel
            _, t_rank, t_size, *first = start  # slice, or a flat range of one (ZeRO's)
            want = tensor_parallel.local_shape(name.rsplit("/", 1)[-1], shape, t_size)
            local = int(np.prod(want, dtype=np.int64))
            lo = int(first[0]) if first else 0
            fits = (0 <= lo <= local - arr.size) if first else arr.size == local
            if not fits or not 0 <= t_rank < t_size:
                raise CheckpointError(
                    f"shard piece {name!r}: not a 1/{t_size} slice of {shape} (or a range of one)"
                )
            where = ["tensor", int(t_rank), int(t_size), *([lo] if first else [])]
        elif not 0 <= start <= start + arr.size <= count:
            raise CheckpointError(
                f"shard piece {name!r}: elements {start}..{start + arr.size} outside {shape}"
            )
        else:
            where = int(start)
        datasets.append((name, arr, ""))
        table[name] = [arr.dtype.str, [int(d) for d in shape], where, int(arr.size)]
    attrs = {
        "format": fmt.FORMAT,
        "hpctrain_version": __version__,
        "step": int(step),
        "shard": int(rank),
        "shard_of": int(size),
    }
    folder = Path(directory) / fmt.shards_dir_name(step)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {folder}: {exc}") from exc
    snap = writer.Snapshot(int(step), datasets, attrs)
    name = fmt.shard_name(rank, size)
    path, digest = writer.write_file(folder, name, snap, tidy=False, faults=faults)
    return {"file": path.name, "digest": digest, "bytes": path.stat().st_size, "pieces": table}


def write_rank_state(
    directory: str | Path,
    step: int,
    rank: int,
    size: int,
    arrays: dict[str, np.ndarray],
    faults: Faults = NO_FAULTS,
) -> dict:
    """Write this rank's private memory (arrays that are this rank's alone and matter only
    to it: error-feedback residuals) as its own file in the checkpoint's shard directory;
    return its record for the commit. Only the same rank of a job of the same size reads
    it back (reader.read_rank_state), so a resume reads 1 file per rank, not N: at
    1,024 or 4,096 ranks each rank still reads one model-sized file."""
    datasets = []
    for key, arr in arrays.items():
        name = f"rank/{key}"
        writer._check_path("rank state", name)
        datasets.append((name, fmt.check_array(f"rank state {key!r}", np.asarray(arr)), ""))
    attrs = {
        "format": fmt.FORMAT,
        "hpctrain_version": __version__,
        "step": int(step),
        "rank": int(rank),
        "rank_of": int(size),
    }
    folder = Path(directory) / fmt.shards_dir_name(step)
    snap = writer.Snapshot(int(step), datasets, attrs)
    name = fmt.rank_state_name(rank, size)
    path, digest = writer.write_file(folder, name, snap, tidy=False, faults=faults)
    return {"rank": int(rank), "file": path.name, "digest": digest}


def shard_table(records: list) -> dict:
    """The commit's table from every rank's record (None: a rank without pieces)."""
    files = [r for r in records if r is not None]
    order: dict[str, None] = {}
    for r in files:
        order.update(dict.fromkeys(r["pieces"]))
    return {"order": list(order), "files": files}


def shards_dir(commit: Path) -> Path | None:
    step = fmt.step_of(commit.name)
    return None if step is None else commit.parent / fmt.shards_dir_name(step)


_warned: set[str] = set()


def remove_shard_folder(folder: str | Path) -> list[str]:
    """Delete hpctrain's files in a shard folder, then the folder if that emptied it.

    Anything else in it (a user's note, a copy put there by hand) is not hpctrain's to
    delete: it stays, with the folder, and its names are returned for a warning.
    """
    foreign = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            if fmt.SHARD_MEMBER_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            else:
                foreign.append(entry.name)
        if not foreign:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(folder)
    if foreign and str(folder) not in _warned:
        _warned.add(str(folder))  # once a process: pruning looks again at every save
        log.warning(
            "%s: left in place, it holds files hpctrain did not write: %s",
            folder,
            ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else ""),
        )
    return foreign


def remove_shards(commit: Path) -> None:
    """Remove a checkpoint's shard directory (after its commit file was removed)."""
    folder = shards_dir(commit)
    if folder is not None and folder.is_dir():
        remove_shard_folder(folder)


def remove_uncommitted(directory: str | Path, step: int) -> None:
    """A failed sharded save's files, when no commit refers to them."""
    directory = Path(directory)
    if not (directory / fmt.checkpoint_name(step)).exists():
        remove_shard_folder(directory / fmt.shards_dir_name(step))


def remove_orphans(directory: str | Path, below: int) -> list[Path]:
    """Shard directories of steps below `below` that no commit file refers to: saves
    that crashed before their commit (every rank has finished any save below `below`)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            m = fmt.SHARDS_RE.match(entry.name)
            if m is None or int(m.group(1)) >= below or not entry.is_dir():
                continue
            commit = os.path.join(directory, fmt.checkpoint_name(int(m.group(1))))
            if not os.path.exists(commit) and not remove_shard_folder(entry.path):
                removed.append(Path(entry.path))
    return removed
