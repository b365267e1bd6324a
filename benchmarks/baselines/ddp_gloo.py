"""torch DistributedDataParallel over Gloo: the peer a CPU user would pick instead.

The same zoo model and per-rank batch as the other baselines, wrapped in DDP with its
defaults (gradient buckets allreduced by Gloo while backward still runs). mpirun only
starts the processes: rank and size come from its environment, and rank 0's address
and a free port reach the others through one mpi4py broadcast (the rendezvous
torchrun would otherwise do); every gradient byte then travels over Gloo.

    mpirun -np 2 python benchmarks/baselines/ddp_gloo.py --model mlp --task vectors
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _synthetic  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from hpctrain.backends.torch import build_model  # noqa: E402


def rendezvous(comm) -> str:
    """tcp://address:port of rank 0, agreed through MPI."""
    address = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        address = f"tcp://{socket.gethostbyname(socket.gethostname())}:{port}"
    return comm.bcast(address, root=0)


def main():
    args = _synthetic.parse_args(__doc__.splitlines()[0])
    comm = MPI.COMM_WORLD
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous(comm),
        rank=comm.rank,
        world_size=comm.size,
        timeout=timedelta(seconds=300),
    )
    model = DDP(build_model(_synthetic.model_cfg(args), _synthetic.input_spec(args), seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * comm.size)
    x, y = _synthetic.fixed_batch(args, seed=comm.rank)
    data, target = torch.from_numpy(x), torch.from_numpy(y)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    _synthetic.run(benchmark_step, args, comm.rank, comm.size, "torch DDP (Gloo)")
    # Nobody closes its Gloo connections while a peer may still use them: a rank that
    # tore down first made the other's Gloo loop abort (rc 134, three times on 26 Nov).
    dist.barrier()
    dist.destroy_process_group()
    comm.Barrier()
    # Then leave without the interpreter's finalisation: a Gloo worker thread still
    # finishing DDP's Python callback takes the GIL while Python shuts down and aborts
    # the process ("terminate called without an active exception" in
    # ProcessGroupGloo::runLoop -> PyEval_AcquireThread; 2-3 in 20 runs on 27 Nov, after
    # the measurement was written). MPI is finalised first, so mpirun sees a clean end.
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
