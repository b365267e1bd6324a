"""Process memory facts for metrics: measured by the kernel, not estimated."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """The highest resident set size this process has had (getrusage: KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
