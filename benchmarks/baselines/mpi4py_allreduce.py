"""The simplest correct data parallelism: one synchronous MPI_Allreduce per step.

After backward, every gradient is copied into one flat float32 buffer, summed across
ranks with mpi4py's buffer `Allreduce` (near C speed, no pickling), divided by the
number of ranks and copied back; then the optimizer steps. No background thread, no
overlap, no fusion logic: the floor any framework-level allreduce should beat or match.
Same zoo model and batch as hpctrain; `--backend torch|tensorflow`.

    mpirun -np 2 python benchmarks/baselines/mpi4py_allreduce.py --backend torch
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _synthetic  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD


def torch_step(args):
    import torch
    import torch.nn.functional as F

    from hpctrain.backends.torch import build_model

    torch.set_num_threads(args.threads)
    model = build_model(_synthetic.model_cfg(args), _synthetic.input_spec(args), seed=0)
    params = list(model.parameters())
    for p in params:  # same start on every rank
        comm.Bcast(p.data.numpy(), root=0)
    optimizer = torch.optim.SGD(params, lr=0.01 * comm.size)
    flat = np.zeros(sum(p.numel() for p in params), dtype=np.float32)
    x, y = _synthetic.fixed_batch(args, seed=comm.rank)
    data, target = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=torch.from_numpy(flat))
        if not args.no_allreduce:
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        np.divide(flat, comm.size, out=flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(torch.from_numpy(flat[offset : offset + n]).view_as(p.grad))
            offset += n
        optimizer.step()

    return step


def tf_step(args):
    import tensorflow as tf

    from hpctrain.backends.tensorflow import build_model

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    net = build_model(_synthetic.model_cfg(args), _synthetic.input_spec(args), seed=0)
    variables = list(net.vars.values())
    for v in variables:
        value = v.numpy()
        comm.Bcast(value, root=0)
        v.assign(value)
    lr = 0.01 * comm.size
    sizes = [int(np.prod(v.shape)) for v in variables]
    x, y = _synthetic.fixed_batch(args, seed=comm.rank)
    data, target = tf.constant(x), tf.constant(y)

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            logits = net(data, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(target, logits))
        return tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(loss, variables)], 0)

    @tf.function
    def apply(flat):
        for v, g in zip(variables, tf.split(flat, sizes)):
            v.assign_sub(lr * tf.reshape(g, v.shape))

    def step():
        flat = grads().numpy()
        if not args.no_allreduce:
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        flat /= comm.size
        apply(tf.constant(flat))

    return step


def _flags(p):
    p.add_argument("--backend", default="torch", choices=("torch", "tensorflow"))
    p.add_argument(
        "--no-allreduce",
        action="store_true",
        help="skip the Allreduce: independent processes, the compute-only ceiling",
    )


def main():
    args = _synthetic.parse_args(__doc__.splitlines()[0], add=_flags)
    step = torch_step(args) if args.backend == "torch" else tf_step(args)
    what = "independent processes" if args.no_allreduce else "mpi4py Allreduce"
    _synthetic.run(step, args, comm.rank, comm.size, f"{what} ({args.backend})")


if __name__ == "__main__":
    main()
