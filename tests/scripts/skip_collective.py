"""Rank SKIP_RANK never enters a guarded barrier (watchdog test)."""

import os
import sys
import time

from hpctrain.runtime import run_fail_together, world


def main():
    w = world()  # the default deadline while the ranks start; TIMEOUT for the barrier only
    if w.rank == int(os.environ.get("SKIP_RANK", "1")):
        time.sleep(120)
        return
    world(collective_timeout=float(os.environ.get("TIMEOUT", "3")))
    w.barrier("test barrier")


sys.exit(run_fail_together(main))
