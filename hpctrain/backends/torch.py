"""PyTorch backend: zoo models as nn.Modules, gradients averaged by Horovod or MPI.

Horovod wiring follows Horovod's own recipe: `hvd.DistributedOptimizer` with named
parameters (allreduces start during backward, one per gradient, fused by Horovod),
`backward_passes_per_step` for accumulation, broadcast of parameters and optimizer
state from rank 0, and `synchronize()` before clipping so the clip sees the average.
The `mpi` engine (see `gradient_engine`) instead sums one flat gradient buffer with
`MPI_Allreduce` after backward and never starts Horovod.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import partial

import numpy as np
import torch

from ..exchange import make_reducer
from ..exchange.overlap import OverlapMean
from ..models import zoo
from ..moe.parallel import is_expert_param
from ..runtime import allocator
from ..runtime.comm import under_deadline
from . import gradient_engine, step, torch_moe, torch_tensor, torch_user
from .base import BackendBase, EvalStats, StepStats, build_agreed
from .groups import ModelGroups
from .torch_device import DeviceFeeder, agreed_device, read_later, to_host
from .torch_hooks import weak_hook
from .torch_model import ZooNet, _Layer, build_model, init_stream  # noqa: F401
from .torch_probe import gpu_of_rank, probe  # noqa: F401 - doctor asks the backend module
from .torch_state import TorchStateMixin
from .torch_steps import (  # noqa: F401 - importable from here (stage, worker, tests)
    backward_mean_loss,
    compute_precision,
    evaluate_model,
    export_optimizer_state,
    import_optimizer_state,
    make_loss_scaler,
    make_optimizer,
    prepare_process,
    resident_baseline,
    rng_state,
    set_rng_state,
)
from .torch_transport import process_group_transports
from .torch_zero import make_torch_zero
from .torch_zero3 import TorchZero3


# --- the backend ------------------------------------------------------------------------
class TorchBackend(TorchStateMixin, BackendBase):
    name = "torch"

    def __init__(self, cfg, world, inp: zoo.InputSpec, threads: int, hvd_comm=None, groups=None):
        self.cfg, self.world, self.inp = cfg, world, inp
        self.groups = groups = groups or ModelGroups()  # from the grid (strategy)
        local = getattr(world, "local_size", 1)  # a grid axis has no node layout
        self.device, self.device_reason, shared = agreed_device(cfg, world)
        self.engine, self.engine_reason = gradient_engine.choose(
            cfg, local, threads, world=world, device=self.device.type, gpu_shared=shared
        )
        self.precision = cfg.train["precision"]  # fp32 | bf16 | fp16 (autocast)
        self.scaler = make_loss_scaler(self.precision, self.device.type)
        # the process-group engines' transports (None on the MPI and Horovod engines)
        self._pg = process_group_transports(cfg, self.engine, self.device, world, groups)
        if self._pg is not None:  # the model's axes (tensor, experts) on the groups
            self.groups = groups = groups.on_transports(self._pg)
        seed = cfg.train["seed"]
        rank = world.rank if world is not None else 0
        prepare_process(threads, cfg.train["deterministic"], seed + rank)
        self.rss_before_model = resident_baseline(cfg.optimizer)  # the memory plan's
        # ZeRO-3 builds a zoo model without memory and fills it a unit at a time
        self._lazy = cfg.train["zero"] == 3 and zoo.is_zoo_model(cfg.model["name"])
        lazy_on = self.device if self._lazy else None
        model = build_agreed(world, lambda: build_model(cfg.model, inp, seed, groups, lazy_on))
        if not zoo.is_zoo_model(cfg.model["name"]):  # the zoo draws no random numbers
            torch_user.decorrelate_ranks(seed, rank)
        self.model = model.to(self.device)  # built on the host, moved (lazy: made there)
        self._feed = DeviceFeeder(self.device)
        self._names = OrderedDict((p, n) for n, p in self.model.named_parameters())
        dense = torch_moe.dense_named_parameters(self.model)  # all but MoE experts
        self._dense = [p for _, p in dense]
        self.accum = cfg.train["grad_accum"]
        self.optimizer = self._make_optimizer(dense, hvd_comm)
        self._fence = None  # an async save still copying export_state's views (save())
        self._mirror = None  # a GPU rank's staged exports' pinned buffers (torch_mirror)
        # modules with buffers (BatchNorm statistics) may change them in a forward
        self._forward_writes = any(True for _ in self.model.buffers())
        self._make_exchange()
        # the local experts: their own group in the optimizer, never allreduced
        torch_moe.add_expert_params(self.optimizer, self.model, groups.experts)
        self.broadcast_from_root()
        self.clip = cfg.train["clip_norm"]
        self.tokens = inp.tokens
        self.exchange_step = 0  # optimizer steps taken (reducers' warm-up, local SGD)
        allocator.give_back_freed()  # construction's temporaries: resident only if held

    def _make_optimizer(self, dense: list, hvd_comm):
        """The optimizer of the dense parameters: this rank's ZeRO shard or all of them,
        wrapped in Horovod's DistributedOptimizer on the horovod engine."""
        cfg, params = self.cfg, self._dense
        self.zero = None  # ZeRO-1/2: the optimizer holds this rank's shard only
        # ZeRO over MPI (host numpy) or the process group's transport (on the device)
        transport = self._pg["replicas"] if self._pg is not None else None
        if cfg.train["zero"] == 3:  # parameters sharded too, gathered per unit of layers
            self.zero = TorchZero3(
                self.world,
                self.model,
                params,
                int(cfg.train["zero_unit_mb"] * 2**20),
                partial(make_optimizer, cfg.optimizer),
                prefetch=cfg.train["zero_prefetch"],
                init=self._init_stream() if self._lazy else None,
                transport=transport,
                device=self.device,
                offload=cfg.train["offload"],
            )
            opt = self.zero.optimizer
        elif cfg.train["zero"]:
            make_opt = partial(make_optimizer, cfg.optimizer)
            self.zero = make_torch_zero(cfg, self.world, params, transport, make_opt)
            opt = self.zero.optimizer
        else:
            opt = make_optimizer(cfg.optimizer, params)
        self.hvd = None
        if self.engine != "horovod":
            return opt
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init(comm=hvd_comm if hvd_comm is not None else self.world.comm)
        self.hvd = hvd
        fp16 = cfg.train["compression"] == "fp16"
        return hvd.DistributedOptimizer(
            opt,
            named_parameters=dense,
            compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none,
            backward_passes_per_step=self.accum,
            op=hvd.Average,
        )

    def _init_stream(self):
        """The canonical initial values of this rank's tensors (a lazily built model)."""
        keys = set(self.model.state_dict())
        seed = self.cfg.train["seed"]
        return init_stream(self.cfg.model, self.inp, seed, self.groups, keys)

    def _make_exchange(self) -> None:
        """The engine's gradient buffer (`_flat`): the ZeRO partition, a reducer, a
        torch.distributed process group or the overlapped buckets."""
        cfg, world, params = self.cfg, self.world, self._dense
        # a compressor on the process-group engines: on the device, after backward
        compress = self._pg is not None and cfg.train["compression"] != "none"
        on = self._pg["replicas"] if compress else world
        shapes = [tuple(p.shape) for p in params]
        self._flat = (
            self.zero.part if self.zero else make_reducer(cfg, on, shapes, engine=self.engine)
        )
        self._overlap = None  # buckets started from backward hooks (exchange/overlap.py)
        pg = self._pg is not None and self.zero is None and not compress
        if self.engine == "overlap" or pg:
            transport, poll_s = world, 0.0005  # MPI on host numpy
            if pg:  # the buckets on the device (nccl / gloo)
                transport = self._pg["replicas"]
                poll_s = 0.0  # Gloo and NCCL progress on their own threads and streams
            sizes, bucket = [p.numel() for p in params], int(cfg.train["bucket_mb"] * 2**20)
            self._overlap = self._flat = OverlapMean(
                transport if world is not None and world.size > 1 else None,
                sizes,
                bucket,
                poll_s=poll_s,
            )
            # torch views of the buffer's views (sharing memory with numpy's on MPI)
            self._grad_views = [
                torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in self._overlap.views
            ]
            self._arrived = [False] * len(params)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready, i))
        self._hooks_live = False

    def broadcast_from_root(self) -> None:
        """Make every replica start from rank 0's parameters and optimizer state.

        Horovod's broadcast_optimizer_state initialises an empty optimizer by taking a
        zero-gradient step; for Adam that advances the step count to 1 and changes the bias
        correction of every later step. A fresh optimizer has nothing to broadcast, so the
        state is only broadcast once it exists (after a resume).
        """
        state = {k: v for k, v in self.model.state_dict().items() if not is_expert_param(k)}
        if self.zero is not None and self.zero.part.stage == 3:  # the shards are rank 0's
            dense = {self._names[p] for p in self._dense}
            state = {k: v for k, v in state.items() if k not in dense}
        if self.hvd is None:
            self._broadcast_with_mpi(state)
            return
        with under_deadline(self.world, "Horovod broadcast of the state"):
            self.hvd.broadcast_parameters(state, root_rank=0)
            # Rank 0 decides for everyone: the branch must be the same on every rank.
            has = bool(self.optimizer.state)
            if self.hvd.broadcast_object(has, root_rank=0, name="has_state"):
                self.hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    def _broadcast_with_mpi(self, state) -> None:
        w = self.world
        if w is None or w.size == 1:
            return
        for name, tensor in state.items():
            if tensor.device.type == "cpu":  # the numpy view shares the tensor's memory
                w.bcast_inplace(tensor.numpy(), what=f"broadcast {name}")
            else:  # a GPU rank stages through the host, once at start-up
                host = to_host(tensor)
                w.bcast_inplace(host, what=f"broadcast {name}")
                tensor.copy_(torch.from_numpy(host))
        if self.zero is not None:  # each rank's optimizer state is its own shard
            self.zero.sync_shard()
            return
        if w.bcast_object(bool(self.optimizer.state), what="agree on optimizer state"):
            named = [(n, p) for p, n in self._names.items() if not is_expert_param(n)]
            kind = self.cfg.optimizer["name"]
            slots = export_optimizer_state(self.optimizer, named, kind) if w.is_root else None
            slots = w.bcast_object(slots, what="broadcast optimizer state")
            import_optimizer_state(self.optimizer, named, kind, slots)

    # --- training ---------------------------------------------------------------

    def train_step(self, micro_batches, lr: float, tally: bool = True) -> StepStats:
        return read_later(step.train_step(self, micro_batches, lr, tally))  # with these below:

    # --- the step's primitives (step.StepPrimitives) ---------------------------
    def begin(self, lr: float) -> None:
        self._train_at(lr)
        self.optimizer.zero_grad()

    def _train_at(self, lr: float) -> None:
        """Training mode at learning rate `lr` (a forward that writes buffers waits
        for an async save's copy first)."""
        if self._forward_writes:
            self._release_exported()
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, micro_batches, tally: bool):
        before_last = self._open_buckets if self._overlap is not None else None
        loss_sum, correct, total = backward_mean_loss(
            self.model,
            micro_batches,
            torch_moe.aux_loss,
            before_last,
            bf16=self.precision,
            feed=self._feed.put,
            scaler=self.scaler,
            tally=tally,
            keep_sums=True,
        )
        return None, loss_sum, correct, total  # the gradients are in param.grad

    def exchange(self, grads):
        if self._overlap is not None:  # on a GPU the waits only order the streams
            self._finish_buckets()
        elif self.hvd is None:
            self._average_with_mpi()
        else:  # Horovod's own stall shutdown runs in its background thread, which a
            # stopped peer leaves blocked in MPI: the job hung with no rank named
            with under_deadline(self.world, "Horovod gradient allreduce"):
                self.optimizer.synchronize()
        torch_moe.average_expert_grads(self.model, self.groups.experts)
        return grads

    def true_scale(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    def clip_tensor_parallel(self, grads, max_norm: float):
        torch_tensor.clip_grad_norm_(list(self.model.named_parameters()), max_norm, self.groups)
        return grads

    def clip_local(self, grads, max_norm: float):
        torch_moe.clip_grad_norm_(self.model, max_norm, self.groups.experts)
        return grads

    def update(self, grads, lr: float) -> None:
        self._release_exported()  # the copy overlapped forward and backward; now update
        if self.scaler is not None:  # skipped (every rank) on an overflow; scale updated
            self._scaled_step()
        elif self.hvd is None:
            self.optimizer.step()
        else:
            with self.optimizer.skip_synchronize():
                self.optimizer.step()

    def moe_metrics(self, step_seconds: float) -> dict:
        return torch_moe.step_extra(self.model, step_seconds)

    def reducer_stats(self) -> dict:
        stats = self._flat.stats() if self.hvd is None else {}
        if self.scaler is not None and self.device.type == "cpu":  # see _scaled_step
            stats["loss_scale"] = float(self.scaler.get_scale())
        return stats

    def _scaled_step(self) -> None:
        """fp16: step unless the averaged gradients overflowed, then grow or back off the
        loss scale (`loss_scale` in the step metrics on CPU ranks; reading it on a GPU
        would synchronise the host)."""
        self.scaler.step(self.optimizer)
        self.scaler.update()

    # ZeRO-1/2 (step.zero_step): local experts have plain gradients, stepped with the shard
    def dense_names(self) -> list[str]:
        return [self._names[p] for p in self._dense]

    def zero_begin(self, lr: float) -> None:
        self._train_at(lr)
        self.zero.begin_step()
        for p in self._expert_params():
            p.grad = None

    def zero_forward_backward(self, micro_batches, tally: bool):
        z, t_comm = self.zero, [0.0]

        def after_backward():  # stage 2 reduces during backward: count it as comm
            t0 = time.perf_counter()
            z.end_backward()
            t_comm[0] += time.perf_counter() - t0

        loss_sum, correct, total = backward_mean_loss(
            self.model,
            micro_batches,
            torch_moe.aux_loss,
            after_each=after_backward,
            bf16=self.precision,
            feed=self._feed.put,
            tally=tally,
            keep_sums=True,
        )
        return self._expert_params(), loss_sum, correct, total, t_comm[0]

    def zero_reduce(self, pending):
        self.zero.reduce()
        torch_moe.average_expert_grads(self.model, self.groups.experts)
        return pending  # the expert parameters (their gradients in param.grad)

    def expert_square_sum(self, experts) -> float | None:
        if not experts:
            return None
        squares = [p.grad.double().pow(2).sum() for p in experts if p.grad is not None]
        # a 0-d tensor where the experts are even without a gradient: a Python 0.0 would
        # take the group's MPI path while its peers sum over the process group (a hang)
        zero = torch.zeros((), dtype=torch.float64, device=experts[0].device)
        return sum(squares, zero)

    def scale_experts(self, experts, coef: float):
        for p in experts:
            if p.grad is not None:
                p.grad.mul_(coef)
        return experts

    def zero_update(self, experts, lr: float) -> None:
        self._release_exported()
        self.zero.step()  # the shard's update (and the local experts', same optimizer)

    def _expert_params(self) -> list:
        return [p for p, n in self._names.items() if is_expert_param(n)]

    def _expert_named(self) -> list:
        return [(n, p) for p, n in self._names.items() if is_expert_param(n)]

    @torch.no_grad()
    def _average_with_mpi(self) -> None:
        """Every dense gradient through the reducer after backward: the `mpi` engine's
        (one MPI_Allreduce, or its exchange method), or a compressor on the process-group
        engines (its buffer on the device)."""
        if self.world is None or self.world.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._dense]
        flat = torch.as_tensor(self._flat.buffer)  # numpy's memory, or the device's buffer
        staged = flat.device != self.device
        if not staged:
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        else:  # host-staged: one device-to-host copy, MPI on the host, one copy back
            flat.copy_(torch.cat([g.reshape(-1) for g in grads]))
        self._flat.reduce(self.exchange_step)
        self.exchange_step += 1
        if staged:
            flat = flat.to(self.device, non_blocking=False)
        for p, view in zip(self._dense, flat.split(self._flat.sizes)):
            if p.grad is not None:  # a parameter without gradient stays without
                p.grad.copy_(view.view_as(p))

    # --- the overlapped engines (exchange/overlap.py over MPI or a process group) ---
    def _open_buckets(self) -> None:
        """The next backward makes the gradients final: let the hooks send them."""
        self._overlap.begin()
        self._arrived = [False] * len(self._dense)
        self._hooks_live = self.world is not None and self.world.size > 1

    @torch.no_grad()
    def _grad_ready(self, index: int, param) -> None:
        if not self._hooks_live:
            return
        self._grad_views[index].copy_(param.grad.reshape(-1))
        self._arrived[index] = True
        self._overlap.ready(index)

    @torch.no_grad()
    def _finish_buckets(self) -> None:
        """Zeros for parameters without gradient (as the sync engine), wait, copy back."""
        if not self._hooks_live:
            return
        self._hooks_live = False
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                self._grad_views[i].zero_()
                self._overlap.ready(i)
        self._overlap.finish()
        for p, view in zip(self._dense, self._grad_views, strict=True):
            if p.grad is not None:  # a parameter without gradient stays without
                p.grad.copy_(view.view_as(p))
        self.exchange_step += 1

    def evaluate(self, x, y) -> EvalStats:
        return evaluate_model(self.model, x, y, self.precision)

    @torch.no_grad()
    def predict(self, x) -> np.ndarray:
        self.model.eval()
        with compute_precision(self.precision, self.device.type):
            return to_host(self.model(torch.from_numpy(x).to(self.device)).float())

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics, which Horovod leaves per replica."""
        self._release_exported()
        for name, buf in self.model.named_buffers():
            if self.hvd is not None:
                with under_deadline(self.world, f"Horovod buffer average {name}"):
                    buf.copy_(self.hvd.allreduce(buf, name=f"buffer.{name}", op=self.hvd.Average))
            elif buf.device.type == "cpu":  # the numpy view shares the buffer's memory
                gradient_engine.average_array(self.world, buf.numpy(), f"average buffer {name}")
            else:
                host = to_host(buf)
                gradient_engine.average_array(self.world, host, f"average buffer {name}")
                buf.copy_(torch.from_numpy(host))

    def versions(self) -> dict[str, str]:
        from . import versions

        return versions("torch")
