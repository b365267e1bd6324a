"""Scripts that run inside every rank of an mpirun job started by a section."""
