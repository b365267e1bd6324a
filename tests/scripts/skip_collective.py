"""Rank SKIP_RANK never enters a guarded barrier (watchdog test)."""

import os
import sys
import time

from hpctrain.runtime import run_fail_together, world


def main():
    w = world(collective_timeout=float(os.environ.get("TIMEOUT", "3")))
    if w.rank == int(os.environ.get("SKIP_RANK", "1")):
        time.sleep(120)
        return
    w.barrier("test barrier")


sys.exit(run_fail_together(main))
