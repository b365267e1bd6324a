"""Run pytest inside every rank of an mpirun job: `mpirun -np N python tests/mpi_pytest.py ...`.

Rank 0 reports normally. Other ranks keep their report in a file and print it (prefixed
with the rank) only when they fail, so a failure on any rank is visible without N copies
of every line. pytest-timeout's thread method ends a stuck rank with os._exit, which
makes mpirun end the others; the Makefile's `timeout` is the last resort.
"""

import os
import sys
import tempfile

import pytest

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
args = sys.argv[1:] + ["-p", "no:cacheprovider", "--color=no", "-o", "timeout_method=thread"]
if rank == 0:
    sys.exit(pytest.main(args))

with tempfile.TemporaryFile(mode="w+") as log:
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        code = pytest.main(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    if code != 0:
        log.seek(0)
        for line in log:
            sys.stdout.write(f"[rank {rank}] {line}")
        sys.stdout.flush()
    sys.exit(code)
