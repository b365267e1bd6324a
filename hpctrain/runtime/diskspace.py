"""Full disks said plainly: how much space a directory has left, in one line.

Writers of data sets and metrics call `no_space(path, exc)` on an OSError, so a full disk
becomes one message naming the file and the free space instead of a traceback (or, in
HDF5's case, a crash), and `check_room(path, need)` refuses before writing at all.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


def no_space(path: str | Path, need: int | None = None) -> str:
    """'no space left on the disk of PATH (N free[, M needed])'."""
    needed = f", {human(need)} needed" if need is not None else ""
    return f"no space left on the disk of {path} ({human(free_bytes(path))} free{needed})"


def check_room(path: str | Path, need: int) -> str | None:
    """A `no_space` message when the disk of `path` has less than `need` bytes free."""
    free = free_bytes(path)
    if free is not None and free < need:
        return no_space(path, need)
    return None
