"""Raw Horovod + TensorFlow 2, written the way Horovod's docs write it, default settings.

Horovod's TF2 recipe wraps the tape in `hvd.DistributedGradientTape`, which fails under
Keras 3 (horovod issue 4290), so the gradients are averaged with the documented
`hvd.grouped_allreduce` inside the same `tf.function`, as the tape would do. Same zoo
model (hpctrain.backends.tensorflow.build_model) and batch as hpctrain; plain SGD.

    mpirun -np 2 python benchmarks/baselines/raw_horovod_tf.py --model cnn
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _synthetic  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

from hpctrain.backends.tensorflow import build_model  # noqa: E402


def main():
    args = _synthetic.parse_args(__doc__.splitlines()[0])
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()

    net = build_model(_synthetic.model_cfg(args), _synthetic.input_spec(args), seed=0)
    variables = list(net.vars.values())
    lr = 0.01 * hvd.size()
    hvd.broadcast_variables(variables + list(net.buffers.values()), root_rank=0)

    x, y = _synthetic.fixed_batch(args, seed=hvd.rank())
    data, target = tf.constant(x), tf.constant(y)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            logits = net(data, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(target, logits))
        grads = hvd.grouped_allreduce(tape.gradient(loss, variables), op=hvd.Average)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)

    def benchmark_step():
        train_step()

    _synthetic.run(benchmark_step, args, hvd.rank(), hvd.size(), "raw Horovod (tensorflow)")


if __name__ == "__main__":
    main()
