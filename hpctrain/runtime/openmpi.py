"""Open MPI settings hpctrain chooses for the user, set before MPI starts.

Open MPI reads its MCA parameters from `OMPI_MCA_<name>` environment variables once, at
MPI_Init, so they must be in the environment before `mpi4py.MPI` is imported: that is
why they live here, in the runtime layer that starts MPI (`world()`), and not in the
training loop. Each is a default only (`os.environ.setdefault`): a value the user or
the launcher set (`mpirun --mca ...`, an exported `OMPI_MCA_...`) wins. Other MPI
libraries ignore these variables.

Why each value (measured with `make bench`, network section, over the emulated
1 Gbit/s link unless said otherwise):

- `mpi_yield_when_idle=1` (config `runtime.mpi_yield_when_idle`): ranks waiting in MPI
  give their core to ranks still computing; essential when ranks share cores,
  harmless otherwise.
- `btl_tcp_links` (config `runtime.tcp_links`, default 2): two connections per peer
  let a ring send and receive at line rate at once (a 5.3 MB MPI_Allreduce 82.8 ms
  with one, 44.4 ms with two, 43.3 ms with four).
- `coll_libnbc_iallreduce_algorithm=3`: the non-blocking allreduce (the overlapped
  engine's buckets) by Rabenseifner's reduce-scatter + allgather: libnbc's default
  took 53 ms for 5.3 MB where the blocking allreduce takes 44; Rabenseifner 44-46 ms,
  progressed by tests alone.
- `btl_tcp_eager_limit` and `btl_tcp_max_send_size` = 512 KB: TCP messages up to
  512 KB go eagerly, without the rendezvous handshake. The 16-bit rings send 256 KB
  pieces so that the kernel moves one while numpy encodes the next; with Open MPI's
  64 KB each piece waited for the receiver's answer (fp16 step over 1 Gbit/s
  35.3 -> 31.1 ms, bf16 32.3 -> 29.5; the dense allreduce unchanged).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OpenMpiDefaults:
    """The configurable part of hpctrain's Open MPI defaults (see the module docstring)."""

    yield_when_idle: bool = True
    tcp_links: int = 2

    def variables(self) -> dict[str, str]:
        """The `OMPI_MCA_*` variables and the values hpctrain sets when they are unset."""
        out = {}
        if self.yield_when_idle:
            out["OMPI_MCA_mpi_yield_when_idle"] = "1"
        out["OMPI_MCA_btl_tcp_links"] = str(int(self.tcp_links))
        out["OMPI_MCA_coll_libnbc_iallreduce_algorithm"] = "3"
        out["OMPI_MCA_btl_tcp_eager_limit"] = "524288"
        out["OMPI_MCA_btl_tcp_max_send_size"] = "524288"
        return out

    def apply(self, env: MutableMapping[str, str] | None = None) -> None:
        """Set each variable the user or launcher left unset (before MPI_Init)."""
        env = os.environ if env is None else env
        for name, value in self.variables().items():
            env.setdefault(name, value)
