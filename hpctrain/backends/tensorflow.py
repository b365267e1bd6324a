"""TensorFlow backend: zoo models on raw tf ops, gradients averaged by Horovod or MPI.

Horovod 0.28.1's DistributedGradientTape and Keras callbacks fail under Keras 3
(`'Variable' object has no attribute 'ref'`, horovod issue 4290), while its tensor
collectives work. So gradients come from a plain `tf.GradientTape` and are averaged
with one `hvd.grouped_allreduce` per step (Horovod fuses the group), variables are
plain `tf.Variable`s broadcast from rank 0, and the optimizers apply exactly torch's
update rules, so both backends produce the same numbers. The `mpi` engine (see
`gradient_engine`) sums one flat gradient buffer with `MPI_Allreduce` instead and never
starts Horovod.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from . import tf_env, tf_import  # noqa: F401  (TF imported with its start-up noise off)

# isort: split
import tensorflow as tf

from ..exchange import make_reducer
from ..exchange.overlap import OverlapMean
from ..models import zoo
from ..moe.parallel import is_expert_param
from ..runtime.comm import under_deadline
from . import gradient_engine, step, tensorflow_moe, tensorflow_user
from .base import (
    BackendBase,
    EvalStats,
    StepStats,
    build_agreed,
    init_stream,
)
from .groups import ModelGroups
from .tensorflow_model import (  # noqa: F401 - importable from here (stage, worker, tests)
    ZooNet,
    assign_weights,
    build_model,
    dense_grads,
    eval_sums,
    evaluate_with,
    logit_sums,
    net_weights,
    traced,
)
from .tensorflow_optim import _clip_like_torch, _clip_tensor_parallel, _Optimizer
from .tensorflow_state import (  # noqa: F401 - importable from here
    TensorFlowStateMixin,
    configure_threads,
    prepare_process,
    rng_state,
    set_rng_state,
)
from .tensorflow_zero import TensorFlowZero
from .tensorflow_zero3 import TensorFlowZero3

tf_env.quiet_python_loggers()


def probe() -> dict:
    """Versions and Horovod build facts, for `hpctrain doctor`."""
    import horovod
    import horovod.tensorflow as hvd
    import keras

    built = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built()}
    missing = [k for k in ("MPI", "Gloo") if not built[k]]
    ops = ", ".join(k for k, v in built.items() if v) or "none"
    gpus = len(tf.config.list_physical_devices("GPU"))
    return {
        "framework": f"{tf.__version__} (Keras {keras.__version__}, GPUs {gpus})",
        "horovod": f"{horovod.__version__}; controllers/ops: {ops}",
        "missing": missing,
    }


class TensorFlowBackend(TensorFlowStateMixin, BackendBase):
    name = "tensorflow"

    def __init__(self, cfg, world, inp: zoo.InputSpec, threads: int, hvd_comm=None, groups=None):
        self.cfg = cfg
        self.world = world
        self.groups = groups = groups or ModelGroups()  # from the grid (strategy)
        local = getattr(world, "local_size", 1)  # a grid axis has no node layout
        self.engine, self.engine_reason = gradient_engine.choose(cfg, local, threads, world=world)
        self.inp = inp
        seed = cfg.train["seed"]
        rank = world.rank if world is not None else 0
        prepare_process(threads, cfg.train["deterministic"], seed + rank)
        self.hvd = self.compression = None
        if self.engine == "horovod":
            import horovod.tensorflow as hvd

            if not hvd.is_initialized():
                hvd.init(comm=hvd_comm if hvd_comm is not None else world.comm)
            self.hvd = hvd
            fp16 = cfg.train["compression"] == "fp16"
            self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        bf16 = cfg.train["precision"] == "bf16"
        lazy = cfg.train["zero"] == 3  # built without its dense parameters: the shard's
        self.net = build_agreed(
            world, lambda: build_model(cfg.model, inp, seed, bf16, groups, lazy=lazy)
        )
        if not zoo.is_zoo_model(cfg.model["name"]):  # the zoo draws no random numbers
            tensorflow_user.decorrelate_ranks(seed, rank)
        self.clip = cfg.train["clip_norm"]
        self._dense = [n for n in self.net.shapes if not is_expert_param(n)]
        self.zero = None  # ZeRO-1/2: the optimizer holds this rank's shard only
        if lazy:  # ZeRO-3: the parameters too, gathered a unit of layers at a time
            self.zero = TensorFlowZero3(
                world,
                self.net,
                int(cfg.train["zero_unit_mb"] * 2**20),
                lambda variables: _Optimizer(cfg.optimizer, variables),
                init_stream(cfg.model, inp, seed, groups, {*self.net.shapes, *self.net.buffers}),
                prefetch=cfg.train["zero_prefetch"],
            )
            self.optimizer, self._flat = self.zero.optimizer, self.zero.part
            self.expert_optimizer = self._expert_optimizer(cfg)
        elif cfg.train["zero"]:
            self.zero = TensorFlowZero(
                world,
                [self.net.vars[n] for n in self._dense],
                cfg.train["zero"],
                int(cfg.train["bucket_mb"] * 2**20),
                lambda variables: _Optimizer(cfg.optimizer, variables),
            )
            self.optimizer = self.zero.optimizer
            self._flat = self.zero.part
            self.expert_optimizer = self._expert_optimizer(cfg)
        else:
            self.optimizer = _Optimizer(cfg.optimizer, self.net.vars)
            self._flat = make_reducer(
                cfg, world, [tuple(self.net.vars[n].shape) for n in self._dense], engine=self.engine
            )
        if self.engine == "overlap":
            # TF computes every gradient in one tape.gradient call: nothing is final
            # before it returns, so the buckets travel after it (pipelined with each
            # other, not with backward).
            self._flat = OverlapMean(world, self._flat.sizes, int(cfg.train["bucket_mb"] * 2**20))
            self.engine_reason += "; TensorFlow sends the buckets after tape.gradient"
        self.exchange_step = 0  # optimizer steps taken (reducers' warm-up, local SGD)
        self.broadcast_from_root()
        self._grad_fn = traced(self._grads, self.net)
        self._eval_fn = traced(lambda x, y: eval_sums(self.net, x, y), self.net)

    def _expert_optimizer(self, cfg):
        """ZeRO: MoE experts are local to a rank: their own optimizer, beside the
        shard's (None without experts)."""
        experts = OrderedDict((n, v) for n, v in self.net.vars.items() if is_expert_param(n))
        return _Optimizer(cfg.optimizer, experts) if experts else None

    def broadcast_from_root(self) -> None:
        """Every replica takes rank 0's variables and optimizer state.

        Horovod's broadcast_variables runs in a tf.function that fails on Keras 3
        variables ('SymbolicTensor' object has no attribute 'assign'), so each variable is
        broadcast eagerly and assigned here; this works for tf.Variable and Keras alike.
        """
        if self._size() == 1:
            return
        opt = self.optimizer
        if self.zero is not None:  # each rank's optimizer state is its own shard
            dense = [v for k, v in self.net.vars.items() if not is_expert_param(k)]
            for i, var in enumerate([*dense, *self.net.buffers.values()]):
                var.assign(self.world.bcast_inplace(np.array(var.numpy()), what=f"broadcast {i}"))
            self.zero.sync_shard()
            return
        everything = [  # MoE experts differ per rank: never broadcast
            *(v for k, v in self.net.vars.items() if not is_expert_param(k)),
            *self.net.buffers.values(),
            *(v for slot in opt.slots.values() for k, v in slot.items() if not is_expert_param(k)),
            opt.step,
            opt.started,
        ]
        for i, var in enumerate(everything):
            if self.hvd is None:
                value = np.array(var.numpy())  # 0-d stays 0-d (ascontiguousarray: 1-d)
                var.assign(self.world.bcast_inplace(value, what=f"broadcast variable {i}"))
                continue
            with under_deadline(self.world, f"Horovod broadcast of variable {i}"):
                value = self.hvd.broadcast(
                    tf.convert_to_tensor(var), root_rank=0, name=f"hpctrain.bcast.{i}"
                )
            var.assign(value)

    def _size(self) -> int:
        return self.world.size if self.world is not None else 1

    # --- training ---------------------------------------------------------------
    def _grads(self, x, y, scale):
        with tf.GradientTape() as tape:
            logits = tf.cast(self.net(x, training=True), tf.float32)  # bf16: loss in f32
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            loss_sum = tf.reduce_sum(losses)
            scaled = loss_sum * scale
            aux = tensorflow_moe.aux_loss(self.net)  # MoE load balancing, weighted per token
            if aux is not None:
                scaled += aux * tf.cast(tf.size(y), tf.float32) * scale
        variables = list(self.net.vars.values())
        grads = dense_grads(tape.gradient(scaled, variables), variables)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.int64))
        return loss_sum, correct, grads

    def train_step(self, micro_batches, lr: float, tally: bool = True) -> StepStats:
        return step.train_step(self, micro_batches, lr, tally)  # the sequence, with these:

    # --- the step's primitives (step.StepPrimitives) ---------------------------
    def begin(self, lr: float) -> None:
        """Nothing to prepare: the tape starts empty, the rate goes to `update`."""

    def forward_backward(self, micro_batches, tally: bool):
        # counts on every step (`tally` aside): inside the traced step the count costs a
        # CPU rank nothing measurable, and a flag would trace the step twice
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        scale = tf.constant(1.0 / total, tf.float32)
        acc, loss_sum, correct = None, 0.0, 0
        for x, y in micro_batches:
            loss, corr, grads = self._grad_fn(tf.constant(x), tf.constant(y), scale)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
            grads = None  # only `acc` holds the gradients (the MPI engine frees them)
            loss_sum += float(loss)
            correct += int(corr)
        return acc, loss_sum, correct, total

    def exchange(self, grads):
        names = list(self.net.vars)  # MoE experts: local, divided by ranks, not allreduced
        if self.hvd is None:
            return self._average_with_mpi(grads, names)
        experts = self.groups.experts
        with under_deadline(self.world, "Horovod gradient allreduce"):  # as torch.py's
            return tensorflow_moe.average_gradients(
                self.hvd, grads, names, self.compression, experts
            )

    def true_scale(self) -> None:
        """No loss scaling in this backend (fp16 runs on torch)."""

    def clip_tensor_parallel(self, grads, max_norm: float):
        return _clip_tensor_parallel(grads, list(self.net.vars), max_norm, self.groups)

    def clip_local(self, grads, max_norm: float):
        names = list(self.net.vars)
        if tensorflow_moe.has_experts(names):
            return tensorflow_moe.clip_like_torch(grads, names, max_norm, self.groups.experts)
        return _clip_like_torch(grads, max_norm)

    def update(self, grads, lr: float) -> None:
        self.optimizer.apply(grads, tf.constant(lr, tf.float32))

    def moe_metrics(self, step_seconds: float) -> dict:
        return tensorflow_moe.step_extra(self.net, step_seconds)

    def reducer_stats(self) -> dict:
        return self._flat.stats() if self.hvd is None else {}

    # ZeRO-1/2 (step.zero_step): stage 2 reduces after every micro-batch (accumulation
    # keeps only the shard); local experts have their own optimizer beside the shard's
    def dense_names(self) -> list[str]:
        return self._dense

    def zero_begin(self, lr: float) -> None:
        self.zero.begin_step()

    def zero_forward_backward(self, micro_batches, tally: bool):  # counts (as above)
        z = self.zero
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        scale = tf.constant(1.0 / total, tf.float32)
        if self._sharded:  # ZeRO-3: reduced unit by unit during backward
            loss_sum, correct, comm = 0.0, 0, 0.0
            for x, y in micro_batches:
                loss, corr, waited = z.forward_backward(x, y, scale)
                loss_sum, correct, comm = loss_sum + float(loss), correct + int(corr), comm + waited
            pending = (None, z.take_expert_grads(), z.expert_names)
            return pending, loss_sum, correct, total, comm
        acc, loss_sum, correct, comm = None, 0.0, 0, 0.0
        names = list(self.net.vars)
        dense = [names.index(n) for n in self._dense]
        local = [i for i, n in enumerate(names) if is_expert_param(n)]  # MoE experts
        experts = None
        for x, y in micro_batches:
            loss, corr, grads = self._grad_fn(tf.constant(x), tf.constant(y), scale)
            if local:
                mine = [grads[i] for i in local]
                experts = mine if experts is None else [a + g for a, g in zip(experts, mine)]
            grads = [grads[i] for i in dense]
            loss_sum += float(loss)
            correct += int(corr)
            if z.part.stage == 2:
                t0 = time.perf_counter()
                z.reduce(grads)
                comm += time.perf_counter() - t0
            else:
                acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
        pending = (acc, experts, [names[i] for i in local])
        return pending, loss_sum, correct, total, comm

    def zero_reduce(self, pending):
        acc, experts, expert_names = pending
        if acc is not None:
            self.zero.reduce(acc)
        if experts is not None:  # scaled to the batches' mean, averaged over copies
            experts = tensorflow_moe.expert_grads(experts, expert_names, self.groups.experts)
        return experts

    def expert_square_sum(self, experts) -> float | None:
        if experts is None:
            return None
        return sum(float(tf.reduce_sum(tf.cast(g, tf.float64) ** 2)) for g in experts)

    def scale_experts(self, experts, coef: float):
        return None if experts is None else [g * float(coef) for g in experts]

    def zero_update(self, experts, lr: float) -> None:
        self.zero.step(lr)
        if experts is not None:
            self.expert_optimizer.apply(experts, tf.constant(lr, tf.float32))

    def _average_with_mpi(self, grads: list, names: list[str]) -> list:
        """One MPI_Allreduce of every dense gradient (the `mpi` engine); experts / ranks.
        Takes the gradients out of `grads` (the caller's list) as they are copied."""
        size = self._size()
        if size == 1:
            return grads
        # dense: the same tensors
        experts = tensorflow_moe.expert_grads(grads, names, self.groups.experts)
        shapes = [tuple(g.shape) for g in grads]
        at = {n: i for i, n in enumerate(names)}
        for name, view in zip(self._dense, self._flat.views, strict=True):
            i = at[name]
            view[:] = grads[i].numpy().reshape(-1)
            # The buffer holds it now: drop the tape's tensor (`grads` is the caller's
            # list), so the reduced copies below replace the gradients instead of
            # coming on top of them (memory_plan counts one gradient and the buffer).
            grads[i] = experts[i] = None
        self._flat.reduce(self.exchange_step)
        self.exchange_step += 1
        dense = dict(zip(self._dense, self._flat.views, strict=True))
        return [
            tf.constant(dense[n].reshape(shape)) if n in dense else e
            for n, shape, e in zip(names, shapes, experts, strict=True)
        ]

    def evaluate(self, x, y) -> EvalStats:
        if self._sharded:  # ZeRO-3, collective: gathered unit by unit
            return evaluate_with(lambda a, b: logit_sums(self.zero.logits(a), b), x, y)
        return evaluate_with(self._eval_fn, x, y)

    def predict(self, x) -> np.ndarray:
        if self._sharded:
            return self.zero.logits(x).numpy()
        return tf.cast(self.net(tf.constant(x), training=False), tf.float32).numpy()

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics, which stay per replica otherwise."""
        if self.net.buffers and self.hvd is None and self._size() > 1:
            for name, var in self.net.buffers.items():
                value = np.array(var.numpy())  # 0-d stays 0-d (ascontiguousarray: 1-d)
                self.world.allreduce_inplace(value, "sum", f"average buffer {name}")
                var.assign(value / self._size())
        elif self.net.buffers and self._size() > 1:
            names = list(self.net.buffers)
            with under_deadline(self.world, "Horovod buffer average"):
                avg = self.hvd.grouped_allreduce(
                    [self.net.buffers[n] for n in names], op=self.hvd.Average
                )
            for n, value in zip(names, avg, strict=True):
                self.net.buffers[n].assign(value)

    def versions(self) -> dict[str, str]:
        import horovod

        return {"framework": "tensorflow " + tf.__version__, "horovod": horovod.__version__}
