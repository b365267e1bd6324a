"""The on-disk format's fixed parts: names, the 512-byte header, and the digests.

A checkpoint is an HDF5 file created with a 512-byte user block (HDF5 leaves those bytes
alone and finds its superblock at offset 512). After the HDF5 file is closed the header
is written into the user block: a magic line, the format version, the digest of every
byte after the header and the file's length. So every byte of the file is covered: a
flip after the header breaks the digest, a flip inside it breaks the exact rebuild of
the header. The digests inside the file (per dataset and over the manifest) then name
which dataset is damaged when the file was changed and re-stamped, and catch writer bugs.

The digest is the format's: `hpctrain-ckpt-2` (written) uses XXH3-128 (xxhash, ~27 GB/s
here: a 300 MB checkpoint hashes in 11 ms), `hpctrain-ckpt-1` (still read) SHA-256
(~2 GB/s, 150 ms). Both catch every truncation and byte flip; neither is meant to stop
someone who rewrites a file on purpose (they could re-stamp either).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xxhash

from ..errors import CheckpointError


@dataclass(frozen=True)
class Scheme:
    """How a format version hashes: the header's label, the hash, and the attribute names."""

    algorithm: str
    new: Callable
    hex_len: int
    dataset_attr: str | None  # format 1 repeats digest and kind on each dataset; 2: manifest only
    content_attr: str


SCHEMES = {
    "hpctrain-ckpt-1": Scheme("sha256", hashlib.sha256, 64, "sha256", "content_sha256"),
    "hpctrain-ckpt-2": Scheme("xxh3-128", xxhash.xxh3_128, 32, None, "content_digest"),
}
FORMAT = "hpctrain-ckpt-2"  # what this hpctrain writes; it reads every format in SCHEMES
CONTENT_ATTRS = frozenset(s.content_attr for s in SCHEMES.values())
MAGIC = b"HPCTRAIN CHECKPOINT\n"
HEADER_SIZE = 512  # the HDF5 user block; must be a power of two >= 512
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")
TEMP_RE = re.compile(r"^\.(ckpt-\d{8,}|shard-\d{5,}-of-\d{5,})\.h5\.tmp-\d+$")
SHARDS_RE = re.compile(r"^ckpt-(\d{8,})\.shards$")
# What hpctrain writes inside a shard folder: shards, ranks' private states, their temps.
SHARD_MEMBER_RE = re.compile(r"^\.?(shard|rank-state)-\d{5,}-of-\d{5,}\.h5(\.tmp-\d+)?$")
ALLOWED_KINDS = "biufc"  # bool, signed/unsigned int, float, complex: plain numbers only
_CHUNK = 8 << 20


class DigestMismatch(CheckpointError):
    """The header is intact but the bytes after it are not the ones that were written."""

    def __init__(self, message: str, version: str):
        super().__init__(message)
        self.version = version  # the intact header's format, for naming the damage


def checkpoint_name(step: int) -> str:
    """ckpt-00000120.h5: zero-padded so that names sort in step order."""
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
    return f"ckpt-{step:08d}.h5"


def shards_dir_name(step: int) -> str:
    """ckpt-00000120.shards: the directory of a sharded checkpoint's per-rank files."""
    return checkpoint_name(step)[: -len(".h5")] + ".shards"


def shard_name(rank: int, count: int) -> str:
    """shard-00003-of-00004.h5: the file rank 3 of 4 writes."""
    return f"shard-{rank:05d}-of-{count:05d}.h5"


def rank_state_name(rank: int, count: int) -> str:
    """rank-state-00003-of-00004.h5: rank 3's private memory (error-feedback residuals)."""
    return f"rank-state-{rank:05d}-of-{count:05d}.h5"


def step_of(name: str) -> int | None:
    """The step of a checkpoint file name, or None for any other file (temps included)."""
    m = NAME_RE.match(name)
    return int(m.group(1)) if m else None


def step_of_entry(name: str) -> int | None:
    """The step of a checkpoint file or shard folder name (ckpt-<step>.h5/.shards)."""
    m = NAME_RE.match(name) or SHARDS_RE.match(name)
    return int(m.group(1)) if m else None


def set_aside_dir(run_dir: str | Path) -> Path:
    """<run-dir>/previous/<UTC time>/: where what a run leaves behind goes, never deleted
    (--new's earlier run, the later checkpoints --resume FILE abandons, the newer ones
    --resume auto skipped as damaged); named here once so that every one lands alike."""
    return Path(run_dir) / "previous" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def starts_as_checkpoint(path: str | Path) -> bool:
    """The file begins with hpctrain's checkpoint header: what pruning and --overwrite
    require before deleting a file named like a checkpoint (a name alone may be a user's
    file). Reads 20 bytes; a file damaged exactly there is left in place, the safe side."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def temp_name(final_name: str, pid: int) -> str:
    """Hidden, per-process name in the same directory, so os.replace stays atomic."""
    return f".{final_name}.tmp-{pid}"


def is_temp_name(name: str) -> bool:
    return bool(TEMP_RE.match(name))


def check_array(where: str, arr) -> np.ndarray:
    """A plain numeric ndarray in little-endian byte order (what the digest is defined on)."""
    arr = np.asarray(arr)
    if arr.dtype.kind not in ALLOWED_KINDS or arr.dtype.fields is not None:
        raise CheckpointError(
            f"{where}: dtype {arr.dtype} is not a plain number type (bool, int, uint, "
            "float, complex); checkpoints store no objects, strings or records"
        )
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def dataset_digest(path: str, arr: np.ndarray, kind: str = "", fmt: str | None = None) -> str:
    """The format's digest over the dataset's path, dtype, shape, kind tag and raw bytes.

    The path is part of it, so a renamed or swapped dataset fails its own digest.
    """
    fmt = fmt or FORMAT
    arr = np.asarray(arr, order="C")  # ascontiguousarray would make 0-d arrays 1-d
    h = SCHEMES[fmt].new()
    h.update(f"{fmt}\0{path}\0{arr.dtype.str}\0{list(arr.shape)}\0{kind}\0".encode())
    if arr.size:
        h.update(arr.reshape(-1).view(np.uint8))
    return h.hexdigest()


def content_digest(data: bytes, fmt: str | None = None) -> str:
    return SCHEMES[fmt or FORMAT].new(data).hexdigest()


# --- the header in the HDF5 user block -------------------------------------------------
def make_header(digest: str, length: int, fmt: str | None = None) -> bytes:
    fmt = fmt or FORMAT
    algorithm = SCHEMES.get(fmt, SCHEMES[FORMAT]).algorithm
    text = MAGIC + f"format: {fmt}\n{algorithm}: {digest}\nbytes: {length}\n".encode()
    if len(text) > HEADER_SIZE:
        raise CheckpointError("internal error: checkpoint header too long")
    return text + b"\0" * (HEADER_SIZE - len(text))


def _update_from_file(h, fh, start: int, end: int) -> None:
    """Feed the file's bytes [start, end) to `h`, _CHUNK at a time (stops early at EOF)."""
    fh.seek(start)
    remaining = end - start
    buf = bytearray(min(_CHUNK, max(remaining, 0)))
    view = memoryview(buf)
    while remaining > 0:
        n = fh.readinto(view[: min(_CHUNK, remaining)])
        if not n:
            break
        h.update(view[:n])
        remaining -= n


def _hash_file_tail(fh, length: int, fmt: str | None = None) -> str:
    h = SCHEMES[fmt or FORMAT].new()
    _update_from_file(h, fh, HEADER_SIZE, length)
    return h.hexdigest()


def _hash_with_extents(fh, length: int, extents: list[tuple[int, memoryview]]) -> str:
    """The same digest as `_hash_file_tail`, with the raw data taken from memory.

    `extents` are (file offset, bytes) of datasets HDF5 stored contiguously and
    unconverted: those bytes are exactly what was written there, so only the bytes
    between them (HDF5 metadata, a few KB) are read back. Hashing in file order keeps
    the digest identical to hashing the whole file; a load re-reads every byte.
    """
    h = SCHEMES[FORMAT].new()
    pos = HEADER_SIZE
    for offset, data in sorted(extents, key=lambda e: e[0]):
        if offset < pos or offset + len(data) > length:
            raise CheckpointError("internal error: dataset extents overlap or pass the end")
        _update_from_file(h, fh, pos, offset)
        h.update(data)
        pos = offset + len(data)
    _update_from_file(h, fh, pos, length)
    return h.hexdigest()


def stamp_header(path: str | Path, extents: list[tuple[int, memoryview]] | None = None) -> str:
    """Hash the closed HDF5 file, write the header into its user block and fsync it.

    With `extents` (see `_hash_with_extents`) the data is hashed from memory instead of
    being read back: a 300 MB save then reads a few KB, not 300 MB.
    """
    with open(path, "r+b") as fh:
        length = os.fstat(fh.fileno()).st_size
        if extents is None:
            digest = _hash_file_tail(fh, length)
        else:
            digest = _hash_with_extents(fh, length, extents)
        fh.seek(0)
        fh.write(make_header(digest, length))
        fh.flush()
        os.fsync(fh.fileno())
    return digest


def check_header(path: str | Path) -> tuple[str, str]:
    """Refuse anything but an intact, complete hpctrain checkpoint; return (format, digest).

    Reads only plain bytes: a damaged file is never handed to the HDF5 library first.
    """
    try:
        with open(path, "rb") as fh:
            length = os.fstat(fh.fileno()).st_size
            raw = fh.read(HEADER_SIZE)
            if length == 0:
                raise CheckpointError(f"{path}: empty file (a write that never finished?)")
            if not raw.startswith(MAGIC):
                if raw.startswith(HDF5_SIGNATURE):
                    raise CheckpointError(
                        f"{path}: an HDF5 file without an hpctrain checkpoint header "
                        "(not written by hpctrain, or rewritten by another tool)"
                    )
                raise CheckpointError(f"{path}: not an hpctrain checkpoint (no header)")
            fmt, digest, recorded = _parse_header(path, raw)
            if length != recorded:
                what = "truncated" if length < recorded else "has extra bytes"
                raise CheckpointError(
                    f"{path}: file {what}: {length} bytes, {recorded} were written"
                )
            if _hash_file_tail(fh, length, fmt) != digest:
                raise DigestMismatch(
                    f"{path}: file digest mismatch: bytes changed after the checkpoint was written",
                    fmt,
                )
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return fmt, digest


def _parse_header(path, raw: bytes) -> tuple[str, str, int]:
    lines = raw[len(MAGIC) :].split(b"\n")
    fmt_line = lines[0].decode("ascii", "replace")
    if not fmt_line.startswith("format: "):
        raise CheckpointError(f"{path}: checkpoint header damaged (no format line)")
    fmt = fmt_line[len("format: ") :]
    if fmt not in SCHEMES:
        raise CheckpointError(
            f"{path}: unknown checkpoint format version {fmt!r} (this hpctrain reads "
            f"{', '.join(SCHEMES)})"
        )
    scheme = SCHEMES[fmt]
    try:
        digest = lines[1].decode("ascii").removeprefix(f"{scheme.algorithm}: ")
        length = int(lines[2].decode("ascii").removeprefix("bytes: "))
        if len(digest) != scheme.hex_len or length < HEADER_SIZE:
            raise ValueError
    except (IndexError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: checkpoint header damaged") from None
    if make_header(digest, length, fmt) != raw:
        raise CheckpointError(f"{path}: checkpoint header damaged")
    return fmt, digest, length
