"""Shared fixtures. tests/mpi/ only runs inside mpirun (see tests/mpi_pytest.py)."""

import os

collect_ignore = [] if "OMPI_COMM_WORLD_SIZE" in os.environ else ["mpi", "scripts"]
