"""Rank RAISE_RANK raises while the other ranks wait in a collective (fail-together test):
a crash (RuntimeError), or with RAISE_KIND=user a user error only that rank knows about
(a DataError, as an unreadable file on one node would raise)."""

import os
import sys

from hpctrain.errors import DataError
from hpctrain.runtime import run_fail_together, world


def main():
    w = world()
    if w.rank == int(os.environ.get("RAISE_RANK", "1")):
        if os.environ.get("RAISE_KIND") == "user":
            raise DataError(f"cannot read shard.h5 on rank {w.rank}")
        raise RuntimeError(f"boom from rank {w.rank}")
    w.comm.Barrier()  # raw MPI: without fail-together this would wait forever


sys.exit(run_fail_together(main))
