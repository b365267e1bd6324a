"""Mixture of experts with expert parallelism over mpi4py (see docs/moe.md).

- `options`: the `model.moe` config (defaults, validation, capacity rule); no MPI.
- `routing`: top-k, capacity and packing decisions in numpy; no framework, no MPI.
- `parallel`: expert ownership and the Alltoall/Alltoallv exchanges; no framework.

The framework halves (gather/scatter, autograd through the exchanges) are
hpctrain/backends/torch_moe.py and tensorflow_moe.py.
"""

from .options import MOE_DEFAULTS, capacity, is_moe_block, moe_options, validate_moe

__all__ = ["MOE_DEFAULTS", "capacity", "is_moe_block", "moe_options", "validate_moe"]
