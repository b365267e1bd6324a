"""glibc malloc settings that decide CPU training speed: keep freed memory for reuse.

Why: glibc gives blocks above a dynamic threshold (128 KiB, growing to at most 32 MiB)
back to the kernel as soon as they are freed, and trims the heap top past 128 KiB. A CPU
training step frees and reallocates its activation and gradient buffers every step, so
every step page-faults its working set in again: ~250k page faults per second per rank
here (torch cnn, `perf stat`), and 1.5-1.7x the img/s once freed memory is kept
(`make bench`, ablation section). PyTorch's CPU performance guide reaches the same end by
preloading jemalloc or tcmalloc; `mallopt` does it in-process, with no launcher change.
The cost: a rank keeps its peak heap instead of shrinking after it.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1024 * 1024 * 1024
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
KEEPING = f"malloc keeps freed memory (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim 1 GiB)"
_status = "not configured"


def status() -> str:
    """What `keep_freed_memory` did in this process (for logs and `hpctrain doctor`)."""
    return _status


def keeps_freed() -> bool:
    """Whether this process runs with the settings above (not the user's, not glibc's
    defaults): then the heap's peak can stay above the memory a run holds live."""
    return _status == KEEPING


def keep_freed_memory() -> str:
    """Apply the settings unless the user chose an allocator; say what happened."""
    global _status
    _status = _apply()
    return _status


def _apply() -> str:
    if not sys.platform.startswith("linux"):
        return "not Linux: allocator left alone"
    chosen = [k for k in USER_SETTINGS if k in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc")):
        chosen.append("LD_PRELOAD")
    if chosen:
        return f"allocator left to the user's {', '.join(chosen)}"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (OSError, AttributeError):
        return "no mallopt (not glibc): allocator left alone"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        return "mallopt refused the settings: allocator left at its defaults"
    return KEEPING


def give_back_freed() -> int:
    """Return the heap's free memory to the kernel now (glibc `malloc_trim(0)`); 1 if
    any was returned, 0 if none or not glibc.

    Why: building a model frees a model's worth of temporaries (initial values, the
    replicated parameters ZeRO copies into its flat layout), and `keep_freed_memory`
    keeps them resident for reuse; a rank's memory after start-up should be what it
    holds, so the memory plan and the limit check see the real figure. Called once,
    after the backend is built (the settings still hold for the steps)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    trim.argtypes = [ctypes.c_size_t]
    return int(trim(0))
