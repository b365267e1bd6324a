"""Raw Horovod + PyTorch, written the way Horovod's docs write it, default settings.

This is the baseline hpctrain's torch backend must match: the same zoo model (built by
hpctrain.backends.torch.build_model) and batch, trained by the four lines of Horovod's
recipe (init, DistributedOptimizer, broadcast parameters and optimizer state) and
nothing else: no tuning of HOROVOD_* or Open MPI, as a user would first write it.

    mpirun -np 2 python benchmarks/baselines/raw_horovod_torch.py --model cnn
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _synthetic  # noqa: E402
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import optim  # noqa: E402

from hpctrain.backends.torch import build_model  # noqa: E402


def main():
    args = _synthetic.parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--fp16", action="store_true", help="Compression.fp16"),
    )
    hvd.init()
    torch.set_num_threads(args.threads)

    model = build_model(_synthetic.model_cfg(args), _synthetic.input_spec(args), seed=0)
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    x, y = _synthetic.fixed_batch(args, seed=hvd.rank())
    data, target = torch.from_numpy(x), torch.from_numpy(y)

    def benchmark_step():
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    _synthetic.run(benchmark_step, args, hvd.rank(), hvd.size(), "raw Horovod (torch)")


if __name__ == "__main__":
    main()
