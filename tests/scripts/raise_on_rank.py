"""Rank RAISE_RANK raises while the other ranks wait in a collective (fail-together test)."""

import os
import sys

from hpctrain.runtime import run_fail_together, world


def main():
    w = world()
    if w.rank == int(os.environ.get("RAISE_RANK", "1")):
        raise RuntimeError(f"boom from rank {w.rank}")
    w.comm.Barrier()  # raw MPI: without fail-together this would wait forever


sys.exit(run_fail_together(main))
