"""`strategy: data_parallel`: every rank holds the model and trains on its own shard.

Gradients are averaged by the backend's engine (Horovod's, or one flat MPI allreduce:
`train.allreduce`). With mixture-of-experts layers the experts are spread over the
grid's `expert` axis (`parallel.expert` ranks exchange tokens; the whole job unless set)
and each expert's copies average their gradients over the `data` axis, so MoE combines
with data parallelism: np=4 with `parallel.expert: 2` is 2 expert groups x 2 replicas.
"""

from __future__ import annotations

import logging

import numpy as np

from ..backends import backend_class, gpu_memory_budget, plan_before_build, versions
from ..backends.groups import ModelGroups
from ..backends.horovod_env import apply_horovod_env
from ..checkpoint import split_replicated
from ..data import iterate_val
from ..errors import ConfigError
from ..exchange.local_sgd import LocalSchedule, LocalSGDReducer, average_weights
from ..models import zoo
from ..moe import parallel as moe_parallel
from ..runtime.grid import ProcessGrid
from ..shape import JobShape
from ..tensor import parallel as tensor_parallel
from .base import StrategyBase, on_gpu
from .checkpoint_memory import checkpoint_host_bytes
from .memory_check import check_memory, check_memory_plan
from .startup import noop_warnings, replica_axis, settings_text

log = logging.getLogger("hpctrain.memory")


def expert_degree(cfg, world_size: int) -> int:
    """Ranks per expert group along the grid's `expert` axis: `parallel.expert`, else
    the whole job (over the tensor groups, with tensor parallelism) for MoE models."""
    wanted = cfg.parallel["expert"]
    if wanted is not None:
        return wanted
    return JobShape.of(cfg, world_size).replicas if zoo.has_moe(cfg.model) else 1


def _own_slot(key: str) -> bool:
    """An optimizer array that local SGD keeps per rank (rank_state)."""
    return key.startswith("optimizer/")


class DataParallel(StrategyBase):
    def __init__(self, cfg, world, run_dir, threads: int):
        super().__init__(cfg, world, run_dir, threads)
        self.tensor = cfg.parallel["tensor"]
        self.grid = g = ProcessGrid(
            world, expert=expert_degree(cfg, world.size), tensor=self.tensor
        )
        # the model's tensor axis and expert group, from the grid (collective with MoE)
        self.groups = ModelGroups.from_grid(g, moe=zoo.has_moe(cfg.model))
        tcfg = cfg.train
        # Tensor parallelism: the ranks of a tensor group read the same batches and hold
        # one model between them; gradients are averaged over the replicas axis.
        shard, shards = (g.replica, g.num_replicas) if self.tensor > 1 else (world.rank, world.size)
        self.dataset, self.data, self.input_spec = self.build_data(
            shard, shards, tcfg["grad_accum"]
        )
        apply_horovod_env(cfg.horovod, cfg.runtime["collective_timeout"])
        replicas = world
        if self.tensor > 1:
            replicas = g.replicas
        # before any compute, and before the model exists: a clear refusal, not an OOM kill
        planned = check_memory_plan(
            cfg,
            world,
            lambda gpu: plan_before_build(
                cfg, self.input_spec, self.groups, replicas.size, threads, world.rank, gpu
            ),
            log,
            lambda: gpu_memory_budget(cfg, world),
            saves_of=self._checkpoint_bytes,
            params=zoo.param_count(cfg.model, self.input_spec),
        )
        self.backend = backend_class(cfg.backend)(
            cfg, replicas, self.input_spec, threads, groups=self.groups
        )
        self.report_comm = world
        self.step_sums_on_device = on_gpu(self.backend)  # agreed: one device for the job
        self.lr_replicas = JobShape.of(cfg, world.size).replicas
        self.local = None  # local SGD: parameters averaged every train.sync_every steps
        if tcfg["sync_every"] > 1:
            self._start_local_sgd(tcfg)
        if not planned:  # a model the backend plans only once it exists
            saves = self._checkpoint_bytes(False)  # a GPU rank's host is not checked then
            check_memory(self, log, lambda: gpu_memory_budget(cfg, world), saves)

    def _checkpoint_bytes(self, gpu: bool) -> float:
        """Host bytes rank 0 holds for a gathered checkpoint (checkpoint_memory.py): the
        state is gathered, or copied, unless the torch backend exports its replica's
        live tensors (views on a CPU rank)."""
        cfg, w = self.cfg, self.world
        gathers = (
            cfg.backend != "torch"  # TensorFlow exports host copies
            or cfg.train["zero"] > 0
            or self.tensor > 1
            or self._spread_experts()
        )
        return checkpoint_host_bytes(cfg, self.input_spec, w.rank, w.size, gpu, gathers)

    def _start_local_sgd(self, tcfg) -> None:
        b = self.backend
        if b.engine != "mpi":
            raise ConfigError(
                f"train.sync_every={tcfg['sync_every']}: local SGD runs on the MPI engine "
                f"(train.allreduce=mpi or auto), not {b.engine}"
            )
        self.local = LocalSchedule(tcfg["sync_every"], tcfg["local_sgd_warmup_steps"])
        b.wrap_reducer(lambda reducer: LocalSGDReducer(reducer, self.local))
        self._diverged = False  # parameters differ between ranks since the last average

    def describe(self) -> str:
        b, g = self.backend, self.grid
        device = getattr(b, "device", None)  # the torch backend's, with why (auto's choice)
        where = f"on {device} ({b.device_reason}), " if device is not None else ""
        return (
            f"data parallel: {self.cfg.backend} backend, model {self.cfg.model['name']}, "
            f"{where}gradients by {b.engine} ({b.engine_reason}), global batch "
            f"{self.data.global_batch}, {settings_text(self.cfg, replica_axis(g), g.num_replicas)}"
        )

    def layout_warnings(self) -> list[str]:
        tensor = f"parallel.tensor={self.tensor}" if self.tensor > 1 else ""
        g, engine = self.grid, self.backend.engine
        return noop_warnings(self.cfg, self.world, g, g.num_replicas, tensor, engine)

    # --- training -------------------------------------------------------------------
    def step(self, batch, lr: float, tally: bool = True):
        stats = self.backend.train_step(batch, lr, tally)
        if self.tensor > 1 and self.grid.coord["tensor"] != 0:
            # The tensor group computed one batch together: rank 0 of the group reports
            # it, so summed over the job every sample counts once.
            stats.loss_sum, stats.correct, stats.count = 0.0, 0, 0
        if self.local is not None and self.world.size > 1:
            done = self.backend.exchange_step - 1  # the step just taken
            if self.local.average_after(done):
                stats.extra["comm_bytes"] = stats.extra.get("comm_bytes", 0.0) + float(
                    self._average_parameters()
                )
            else:
                self._diverged = not self.local.synchronous(done) or self._diverged
        return stats

    def _average_parameters(self) -> int:
        """Every replica takes the mean parameters (and BatchNorm statistics)."""
        mean, sent = average_weights(self.world, self.backend.get_weights())
        self.backend.set_weights(mean)
        self._diverged = False
        return sent

    def evaluate(self, stop=None) -> np.ndarray | None:
        """Validation sums; None when `stop()` (every rank, once per batch: iterate_val
        gives every rank as many batches) says a rank was signalled."""
        if self.dataset is None or self.dataset.val_size == 0:
            return None
        sums = np.zeros(4)  # loss, correct, count (tokens for language models), samples
        w = self.world
        shard, shards = (
            (self.grid.replica, self.grid.num_replicas) if self.tensor > 1 else (w.rank, w.size)
        )
        for x, y in iterate_val(
            self.dataset, shard, shards, max(256, self.cfg.train["batch_size"])
        ):
            if stop is not None and stop():
                return None
            ev = self.backend.evaluate(x, y)
            sums += (ev.loss_sum, ev.correct, ev.count, len(y))
        if self.tensor > 1 and self.grid.coord["tensor"] != 0:
            sums[:] = 0.0  # counted once per tensor group (rank 0 of the group)
        return sums

    def average_buffers(self) -> None:
        """Before evaluation and checkpoints: with local SGD between averages, the
        replicas' parameters differ, so they are averaged first (then equal)."""
        if self.local is not None and self._diverged:
            self._average_parameters()
        self.backend.average_buffers()

    def finish(self, ctx) -> None:
        if self.local is not None and self._diverged:
            self._average_parameters()  # every replica ends with the same model

    # --- state ------------------------------------------------------------------------
    def export_state(self, staged: bool = False) -> dict | None:
        """Rank 0's canonical state; under ZeRO every rank takes part (the optimizer
        state is gathered from the shards onto rank 0), and with experts spread over
        ranks each expert's weights and optimizer slots are gathered over the expert
        axis (rank 0 receives the experts it lacks: (E - E/R) experts' state, whatever
        the world size; the other ranks send theirs once). `staged` reaches the backend
        where its arrays go to the save untouched (one replica holds the whole state)."""
        if self.tensor > 1:  # the tensor group's pieces joined under canonical names
            experts, dense = moe_parallel.split_experts(self.backend.export_state())
            if experts and self.grid.coord["data"] == 0:  # replica 0's expert x tensor
                experts = moe_parallel.gather_expert_weights(experts, self.groups.experts) or {}
            pieces = self.grid.tensor.gather_arrays(dense, what="gather tensor-parallel shards")
            if not self.world.is_root:
                return None
            joined = {  # each tensor's pieces popped as it is joined: one copy held at a time
                k: tensor_parallel.unshard(k.rsplit("/", 1)[-1], [p.pop(k) for p in pieces])
                for k in list(pieces[0])
            }
            return {**joined, **experts}
        if self._spread_experts():
            state = moe_parallel.gather_expert_weights(
                self.backend.export_state(), self.groups.experts
            )
            return state if self.world.is_root else None
        if getattr(self.backend, "zero", None) is not None:
            state = self.backend.export_state()
            return state if self.world.is_root else None
        return self.backend.export_state(staged) if self.world.is_root else None

    def wait_exported(self) -> None:
        self.backend.wait_exported()

    def hold_exported_state(self, fence) -> bool:
        """The backend fences before its next change of what it exported; local SGD's
        averages change parameters out of its sight, so there the save copies first."""
        return self.local is None and self.backend.hold_exported_state(fence)

    def export_pieces(self, min_bytes: int) -> dict | None:
        """Replicated tensors cut evenly over the writers; under ZeRO each rank's own
        optimizer shard; spread experts written by their own ranks (each expert's copies
        over the data axis share it out like replicated state); tensor-parallel slices
        written by their ranks, and under ZeRO their optimizer shards (ranges of the
        slices)."""
        w = self.world
        zero = getattr(self.backend, "zero", None)
        if self.tensor > 1:
            if zero is None:
                return self._tensor_pieces(min_bytes, self.backend.export_state())
            return self._tensor_pieces(min_bytes, *self.backend.export_owned_state())
        owned = {}
        if zero is None:
            local = self.backend.export_state()
        else:
            local, owned = self.backend.export_owned_state()
        experts, shared = moe_parallel.split_experts(local)
        d = self.grid.data  # an expert's copies share it out as replicated state is
        return {
            **split_replicated(shared, w.rank, w.size, min_bytes),
            **split_replicated(experts, d.rank, d.size, min_bytes),
            **owned,
        }

    def _tensor_pieces(self, min_bytes: int, local: dict, owned: dict | None = None) -> dict:
        """Each rank's slices of the split tensors, as ("tensor", rank, T) pieces: the
        split tensors of `local` (this rank's state) are dealt out over the data replicas
        (tensor i to replica i mod R, all T slices of it from that replica's tensor group);
        the replicated rest is cut over every rank as without tensor parallelism. `owned`
        (ZeRO: {name: (slice shape, first, elements)}, this rank's optimizer shard of
        its slices): ranges of split tensors' slices as ("tensor", rank, T, first); the
        ranges of tensors every tensor rank holds alike from tensor rank 0 alone. Experts
        (each on one rank of the expert x tensor group) are cut over their copies on the
        data axis."""
        w, g = self.world, self.grid.tensor
        slices = {k: tensor_parallel.slice_piece(k, v, g.size, g.rank) for k, v in local.items()}
        experts, rest = moe_parallel.split_experts(
            {k: v for k, v in local.items() if slices[k] is None}
        )
        pieces = split_replicated(rest, w.rank, w.size, min_bytes)
        d = self.grid.data
        pieces.update(split_replicated(experts, d.rank, d.size, min_bytes))
        replicas, mine = self.grid.num_replicas, self.grid.replica
        split = [k for k, piece in slices.items() if piece is not None]
        for i, k in enumerate(split):
            if i % replicas == mine:
                pieces[k] = slices[k]
        for k, (shape, first, elements) in (owned or {}).items():
            piece = tensor_parallel.range_piece(k, shape, first, elements, g.size, g.rank)
            if piece is not None:
                pieces[k] = piece
        return pieces

    def _spread_experts(self) -> bool:
        experts = self.groups.experts
        return zoo.has_moe(self.cfg.model) and experts is not None and experts.size > 1

    def import_state(self, ckpt) -> None:
        state = ckpt.state
        if self._spread_experts():  # every rank takes its own experts, by canonical name
            mine = set(self.backend.weight_shapes())
            state = {
                k: v
                for k, v in state.items()
                if not moe_parallel.is_expert_param(k) or k.rsplit("/", 1)[-1] in mine
            }
        g = self.grid.tensor  # this rank's piece of every split tensor
        self.backend.import_state(tensor_parallel.shard_state(state, g.size, g.rank))
        self.backend.exchange_step = int(ckpt.step)  # warm-ups and local-SGD phases go on

    def weight_shapes(self) -> dict[str, tuple]:
        """Canonical shapes: with experts spread over ranks, every expert's (as saved)."""
        shapes = dict(self.backend.weight_shapes())
        if self.tensor > 1:  # canonical (whole) shapes, as checkpoints hold them
            for spec in zoo.build_layers(self.cfg.model, self.input_spec):
                for name, shape in spec.params.items():
                    shapes[f"{spec.name}.{name}"] = tuple(shape)
        if self._spread_experts():
            for spec in zoo.build_layers(self.cfg.model, self.input_spec):
                for name, shape in spec.params.items():
                    if moe_parallel.is_expert_param(f"{spec.name}.{name}"):
                        shapes[f"{spec.name}.{name}"] = tuple(shape)
        return shapes

    def rank_state(self) -> dict[str, np.ndarray]:
        """This rank's private memory: the gradient reducer's (error-feedback residuals,
        PowerSGD's warm-start factors: exchange/compression/lossy.py) and, under local
        SGD, its optimizer state (only the parameters are averaged: each rank's moments
        are its own, and the canonical state holds one copy of them); {} for the dense
        engines, Horovod and ZeRO."""
        state = dict(self.backend.reducer_state())
        if self.local is not None and self.world.size > 1:  # views of the live tensors:
            # every rank writes its file on this thread, before the next step changes them
            state.update({k: v for k, v in self.backend.export_state().items() if _own_slot(k)})
        return state

    def load_rank_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.backend.load_reducer_state({k: v for k, v in arrays.items() if not _own_slot(k)})
        own = {k: v for k, v in arrays.items() if _own_slot(k)}
        if own:  # local SGD: this rank's optimizer state over the checkpoint's one copy
            self.backend.import_state({**self.backend.export_state(), **own})

    def rng_state(self) -> dict[str, np.ndarray]:
        return self.backend.rng_state()

    def set_rng_state(self, state: dict[str, np.ndarray]) -> None:
        self.backend.set_rng_state(state)

    def checkpoint_attrs(self) -> dict:
        return versions(self.cfg.backend)
