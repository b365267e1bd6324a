"""`hpctrain` with its compute thread at a lower priority than Horovod's background thread.

An experiment for the ablation, not a hpctrain option: after the torch backend has
called `hvd.init` (which starts Horovod's background thread at the caller's priority),
the main thread, which does all the compute with one thread per rank, raises its own
nice value (always allowed without privileges). When the background thread wakes for
its cycle it then preempts the compute at once instead of waiting for the end of the
compute's time slice, so both ranks' negotiation steps meet sooner.

    mpirun -np 2 python benchmarks/workers/hpctrain_nice.py train ... (same as hpctrain)
"""

from __future__ import annotations

import os
import sys
import threading

NICE = int(os.environ.get("HPCTRAIN_BENCH_COMPUTE_NICE", "5"))


def main() -> int:
    from hpctrain import cli
    from hpctrain.backends import torch as torch_backend

    original = torch_backend.TorchBackend.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)

    torch_backend.TorchBackend.__init__ = init
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
