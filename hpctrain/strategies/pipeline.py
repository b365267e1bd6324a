"""Pipeline-parallel training (`strategy: pipeline`): P stages x D replicas over mpi4py.

The model's layer sequence is cut into P contiguous stages (by parameter count, measured
forward time, or an explicit list) on the grid's `pipe` axis; the D copies of a stage
form its `replicas` axis (runtime/grid.py). Each step every replica runs m
micro-batches through its stages with the GPipe or the 1F1B schedule, activations and
gradients moving as raw buffers between neighbours (pipeline/transport.py, every wait
under a deadline that names the stage that did not answer). Gradients accumulate over
the m micro-batches; each stage's replicas average them (the `mpi` engine: one flat
MPI allreduce on the `replicas` axis; or Horovod process sets); each stage then steps
its optimizer once. The result equals one step of single-process training on the
whole global batch (tests/test_pipeline.py checks it to 1e-5).

With `parallel.tensor: T` the grid is 3-D (data x pipe x tensor): each stage's
transformer blocks are split over its T consecutive ranks (tensor/parallel.py), every
tensor rank of stage s exchanges activations with the same tensor rank of stages s-1 and
s+1 (the activations between stages are whole on every tensor rank), and gradients are
averaged over the data axis of each (stage, tensor) slot. Checkpoints stay canonical:
each tensor rank writes its slices, rank 0 joins them for a gathered state.

On the process-group engines (torch: `train.allreduce: gloo` on CPU ranks, or GPU ranks
sharing a GPU, where Gloo stages the messages through the host; `nccl` on GPU ranks,
the messages on the device, in the order pipeline/transport.py gives) every link is a
process group's and a stage computes on its rank's device: activations, gradients, the
replicas' average and the clip's norm stay tensors there, and nothing in a step reads
back to the host
(tests/scripts/step_reads.py checks every such run over Gloo).
"""

from __future__ import annotations

import importlib
import logging
import math
from functools import cached_property

import numpy as np

from ..backends import (
    gpu_memory_budget,
    plan_stage_before_build,
    process_group_links,
    stage_class,
    stage_device,
    stage_module,
    versions,
)
from ..backends.base import StepStats, cross_entropy_np, layers_init_stream
from ..backends.gradient_engine import PROCESS_GROUP_ENGINES
from ..backends.gradient_engine import choose as choose_engine
from ..backends.groups import ModelGroups
from ..backends.horovod_env import apply_horovod_env
from ..checkpoint import split_replicated
from ..data import iterate_val, val_batch_count
from ..models import zoo
from ..moe import parallel as moe_parallel
from ..moe.options import moe_options
from ..pipeline.engine import chunk_batches, run_inference_stoppable, run_step
from ..pipeline.partition import (
    balanced_counts,
    check_partition,
    parameter_partition,
    stage_bounds,
)
from ..pipeline.schedule import bubble_theory, peak_in_flight, stage_actions
from ..pipeline.transport import StageTransport
from ..runtime.comm import under_deadline
from ..runtime.grid import ProcessGrid
from ..shape import JobShape
from ..tensor import parallel as tensor_parallel
from .base import StrategyBase, on_gpu
from .checkpoint_memory import checkpoint_host_bytes
from .memory_check import check_built, check_memory_plan
from .startup import noop_warnings, replica_axis, settings_text

log = logging.getLogger("hpctrain.memory")


def model_layers(model_cfg: dict, inp: zoo.InputSpec) -> list[zoo.LayerSpec]:
    """A zoo model's layer sequence, or a user's `pkg.module:fn` returning LayerSpecs."""
    name = model_cfg["name"]
    if zoo.is_zoo_model(name):
        return zoo.build_layers(model_cfg, inp)
    module_name, fn_name = name.split(":", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    layers = fn(**{k: v for k, v in model_cfg.items() if k != "name"})
    if not (isinstance(layers, list) and all(isinstance(x, zoo.LayerSpec) for x in layers)):
        raise TypeError(
            f"model.name {name}: the pipeline needs a list of zoo.LayerSpec to cut into "
            f"stages, got {type(layers).__name__}"
        )
    return layers


def config_problem(cfg, world_size: int) -> str | None:
    """What the pipeline refuses before any work (every rank sees the same config)."""
    shape = JobShape.of(cfg, world_size)
    stages, tensor = shape.stages, shape.tensor
    if world_size % shape.ranks_per_replica:
        if tensor == 1:
            return (
                f"world size {world_size} is not divisible by pipeline.stages={stages}: "
                f"launch a multiple of {stages} ranks (stages x data-parallel replicas)"
            )
        return (
            f"world size {world_size} is not divisible by pipeline.stages={stages} x "
            f"parallel.tensor={tensor}: launch a multiple of {shape.ranks_per_replica} ranks "
            "(stages x tensor x data-parallel replicas)"
        )
    if zoo.has_moe(cfg.model) and shape.replicas % expert_degree(cfg, world_size):
        return (
            f"parallel.expert={cfg.parallel['expert']}: each stage's replicas "
            f"({shape.replicas}) must be a multiple of it"
        )
    return None


def expert_degree(cfg, world_size: int) -> int:
    """Ranks of a stage's expert group along the grid's `expert` axis: `parallel.expert`,
    else every replica of the stage (MoE models), else 1."""
    if not zoo.has_moe(cfg.model):
        return 1
    wanted = cfg.parallel["expert"]
    return wanted if wanted is not None else max(1, JobShape.of(cfg, world_size).replicas)


class Pipeline(StrategyBase):
    def __init__(self, cfg, world, run_dir, threads: int, layers=None):
        super().__init__(cfg, world, run_dir, threads)
        w = world
        pcfg = cfg.pipeline
        self.stages, self.micro = pcfg["stages"], pcfg["microbatches"]
        w.agree(config_problem(cfg, w.size))
        self.tensor = cfg.parallel["tensor"]
        self.grid = g = ProcessGrid(
            w, pipe=self.stages, expert=expert_degree(cfg, w.size), tensor=self.tensor
        )
        self.moe = zoo.has_moe(cfg.model)
        # the tensor axis and the experts over each stage's replicas (x its tensor ranks)
        self.groups = ModelGroups.from_grid(g, moe=self.moe)
        self.dataset, self.data, inp = self.build_data(  # prefetch: the ends read data
            g.replica, g.num_replicas, self.micro, g.first or g.last, "pipeline.microbatches"
        )
        self.input_spec = inp
        self.layers, problem = layers, None
        if self.layers is None:
            try:
                self.layers = model_layers(cfg.model, inp)
            except (TypeError, ValueError, ImportError, AttributeError) as exc:
                problem = str(exc)
        w.agree(problem)
        w.agree(check_partition(pcfg["partition"], len(self.layers), self.stages))
        apply_horovod_env(cfg.horovod, cfg.runtime["collective_timeout"])
        self.canonical_shapes = zoo.tensor_shapes(self.layers)
        self.canonical_names = list(self.canonical_shapes)
        self.counts = self._partition(inp)
        start, stop = stage_bounds(self.counts)[g.stage]
        layers = self.layers[start:stop]
        if self.moe:  # this rank's experts only
            layers = moe_parallel.local_layers(layers, cfg.train["seed"], self.groups.experts)
        layers = tensor_parallel.local_layers(layers, self.tensor)
        device, self.device_reason, shared = stage_device(cfg, w)  # a GPU, or the CPU
        self.engine, self.engine_reason = choose_engine(
            cfg, w.local_size, threads, world=w, device=getattr(device, "type", "cpu"),
            gpu_shared=shared,
        )  # fmt: skip
        if self.moe and self.engine not in ("mpi", *PROCESS_GROUP_ENGINES):  # not Horovod's:
            # experts are averaged over their copies beside the stage's dense gradients
            self.engine, self.engine_reason = "mpi", "mixture-of-experts runs on the MPI engine"
        # {} unless train.allreduce is gloo or nccl; then the stage computes on `device`
        self.links = links = self._process_group_links(device)
        self.actions = stage_actions(pcfg["schedule"], g.stage, self.stages, self.micro)
        # before the stage exists: a clear refusal, not an OOM kill (torch's zoo models)
        self._check_memory(inp, (start, stop), layers, threads)
        # the stage's initial values only, drawn one tensor at a time in the model's order
        mine = layers_init_stream(
            self.layers, cfg.train["seed"], g.tensor, zoo.tensor_shapes(layers)
        )
        self.stage = stage_class(cfg.backend)(
            cfg, layers, mine, g.first, g.last, threads, w.rank, self.groups,
            device=device if links else None,
        )  # fmt: skip
        self.zero = cfg.train["zero"]
        self._attach_replicas(links)
        if self.planned is None:  # TensorFlow, a user's model, experts: once built
            self._check_built(inp)
        in_shape, out_shape = self._agree_shapes(inp)
        self.link = StageTransport(
            links.get("pipe", g.pipe),
            g.stage,
            self.stages,
            None if g.first else in_shape,
            None if g.last else out_shape,
            peer_rank=lambda s: g.rank_of(**{**g.coord, "pipe": s}),
            back=links.get("pipe-back"),
            post_ahead=self.engine != "nccl",  # NCCL's in-order streams: transport.py
        )
        self._connect(w)
        # Loss terms of one step on one replica: the loss is their mean (then replica mean).
        self.terms = self.micro * cfg.train["batch_size"] * (inp.shape[0] if inp.tokens else 1)
        self.report_comm = w
        self.step_sums_on_device = on_gpu(self.stage)  # agreed: one device for the job
        self.lr_replicas = g.num_replicas
        self.busy = np.zeros(self.stages)
        self.wall = np.zeros(self.stages)

    def _connect(self, w) -> None:
        """Each link's first call, outside a step (NCCL: pipeline/transport.py), every
        rank's once: one watchdog section names a rank that never comes (creating NCCL's
        communicators has no timeout of its own)."""
        with under_deadline(w, "the pipeline stages connecting"):
            self.link.connect()

    def describe(self) -> str:
        c, g = self.cfg, self.grid
        split = f" x tensor {self.tensor}" if self.tensor > 1 else ""
        return (
            f"pipeline: {c.backend} backend, model {c.model['name']}, {self.stages} stage(s) "
            f"{self.counts}{split} x {g.num_replicas} replica(s), {c.pipeline['schedule']} "
            "schedule, "
            f"{self.micro} micro-batches of {c.train['batch_size']}, gradients by "
            f"{self.engine} ({self.engine_reason}), "
            f"{self._device_text()}"
            f"{settings_text(c, replica_axis(g), g.num_replicas)}"
        )

    def layout_warnings(self) -> list[str]:
        per_replica = f"pipeline.stages={self.stages}"
        if self.tensor > 1:
            per_replica += f" x parallel.tensor={self.tensor}"
        g = self.grid
        return noop_warnings(self.cfg, self.world, g, g.num_replicas, per_replica, self.engine)

    def _device_text(self) -> str:
        device = getattr(self.stage, "device", None)
        if device is None:
            return ""
        return f"stages on {device} ({self.device_reason}), "

    # --- set-up helpers -----------------------------------------------------------
    def _attach_replicas(self, links: dict) -> None:
        """How the stage averages over its replicas: ZeRO-1 (MPI, or their process
        group), one flat allreduce (MPI, or the process group), or Horovod process sets."""
        cfg, w, g = self.cfg, self.world, self.grid
        if self.zero:  # ZeRO-1 over each stage's replicas (MPI, or their process group)
            bucket = int(cfg.train["bucket_mb"] * 2**20)
            self.stage.attach_zero(g.replicas, bucket, links.get("replicas"))
        elif self.engine == "mpi" or links:
            self.stage.attach_mpi(g.replicas, links.get("replicas"))
        elif g.num_replicas > 1:
            mod = stage_module(cfg.backend)
            groups = [
                [g.rank_of(data=d, pipe=s) for d in range(g.num_replicas)]
                for s in range(self.stages)
            ]
            self.stage.attach_replicas(*mod.init_replicas(w.comm, groups, g.stage), g.replicas)

    def _check_memory(self, inp, bounds: tuple[int, int], layers, threads: int) -> None:
        """Plan this rank's stage (`layers`, its part of the model's [start, stop)) and
        refuse, on every rank, a stage that will not fit its rank's limit; the plan is
        kept for the summary (`planned`: (terms, baseline)). Where it cannot be planned
        (None), the stage is checked once built (check_built, in __init__). Cost: each
        rank plans its own stage locally (a meta-device forward of the layers up to its
        stage's end, no memory), then one 4-byte allreduce agrees the errors: the same
        at 1,024 and 4,096 ranks as at 4."""
        cfg, w, g = self.cfg, self.world, self.grid
        start, stop = bounds
        self.planned = None
        self._memory_where = f"stage {g.stage} of {self.stages} (layers {start}-{stop - 1}): "

        def plan_of(gpu: bool):
            self.planned = plan_stage_before_build(
                cfg, inp, self.layers, start, layers, self.groups, g.num_replicas,
                peak_in_flight(self.actions), threads, w.rank, gpu,
            )  # fmt: skip
            return self.planned

        def saves_of(gpu: bool):  # rank 0 gathers every stage's state for one file
            return checkpoint_host_bytes(cfg, inp, w.rank, w.size, gpu, gathers=True)

        params = sum(spec.param_count() for spec in self.layers)  # the whole model's
        check_memory_plan(
            cfg, w, plan_of, log, self._gpu_budget, self._memory_where, True, saves_of, params
        )

    def _check_built(self, inp) -> None:
        """The stage's check once it exists, with rank 0's gathered checkpoint (CPU)."""
        cfg, w = self.cfg, self.world
        saves = checkpoint_host_bytes(cfg, inp, w.rank, w.size, False, gathers=True)
        where = self._memory_where
        check_built(cfg, w, self.stage.memory_plan, log, self._gpu_budget, where, saves)

    @cached_property
    def _moe_stages(self) -> int:
        """How many stages hold MoE layers (as many ranks each): pipeline_metrics'."""
        bounds = stage_bounds(self.counts)
        return sum(any("moe" in spec.attrs for spec in self.layers[a:b]) for a, b in bounds)

    def _gpu_budget(self):
        """The GPU memory a stage on a GPU may use (collective over the node), else None."""
        return gpu_memory_budget(self.cfg, self.world) if self.links else None

    def _process_group_links(self, device) -> dict:
        """The process-group engine's transports over the pipe axis (activations, and
        on a second group the gradients, between stages: pipeline/transport.py says
        why), the stage's replicas (its gradients) and, given to
        the model's groups, their axes (ModelGroups.transport_axes: the blocks'
        activation sums, the experts' token rows and their copies' gradients); {} on
        the other engines (collective over the job)."""
        if self.engine not in PROCESS_GROUP_ENGINES:
            return {}
        axes = ("pipe", "pipe-back", "replicas", *self.groups.transport_axes)
        links = process_group_links(self.cfg, self.engine, self.grid, axes, device)
        self.groups = self.groups.on_transports(links)
        return links

    def _shard(self, state: dict) -> dict:
        """This rank's tensor-parallel piece of every split array of a canonical dict."""
        return tensor_parallel.shard_state(state, self.grid.tensor.size, self.grid.tensor.rank)

    def _partition(self, inp) -> list[int]:
        spec = self.cfg.pipeline["partition"]
        if spec != "time":
            return parameter_partition(spec, self.layers, self.stages)
        # "time": rank 0 measures, everyone uses its numbers (one partition for all).
        costs = None
        if self.world.is_root:
            rng = np.random.default_rng(0)
            shape = (self.cfg.train["batch_size"], *inp.shape)
            x = (
                rng.integers(0, inp.classes, shape)
                if inp.tokens
                else rng.standard_normal(shape).astype(np.float32)
            )
            layer_weights = zoo.iter_layer_weights(self.layers, self.cfg.train["seed"])
            costs = stage_module(self.cfg.backend).layer_forward_seconds(
                self.layers, layer_weights, x
            )
        costs = self.world.bcast_object(costs, what="share measured layer times")
        return balanced_counts(costs, self.stages)

    def _agree_shapes(self, inp) -> tuple[tuple, tuple]:
        """Each stage learns its input shape from the previous one, once, down the pipe."""
        g, b = self.grid, self.cfg.train["batch_size"]
        with g.pipe.watchdog.guard("agree on pipeline message shapes"):
            if g.first:
                in_shape = (b, *inp.shape)
            else:
                in_shape = tuple(g.pipe.comm.recv(source=g.stage - 1, tag=77))
            dtype = np.int64 if (g.first and inp.tokens) else np.float32
            probe = self.stage.infer(np.zeros((1, *in_shape[1:]), dtype=dtype))
            out_shape = (b, *probe.shape[1:])
            if not g.last:
                g.pipe.comm.send(out_shape, dest=g.stage + 1, tag=77)
        return in_shape, out_shape

    # --- training -------------------------------------------------------------------
    def batches(self, epoch: int, position: int):
        g = self.grid
        if g.first or g.last:
            return self.data.iterate(epoch, position)
        return iter([None] * self.data.steps_left(position))

    def step(self, batch, lr: float, tally: bool = True) -> StepStats:
        """One optimizer step of this rank's stage; the numbers the loop sums over ranks
        (correct predictions on the steps it logs: `tally`)."""
        return self.stage.read_later(self.step_sums(batch, lr, tally))

    def step_sums(self, batch, lr: float, tally: bool = True) -> StepStats:
        """The step, its loss and correct counts still where the stage computed them."""
        g, P = self.grid, self.stages
        self.stage.tally_step(tally)
        timing = run_step(self.stage, self.link, self.actions, batch, self.micro, 1.0 / self.terms)
        loss_sum, correct = self.stage.take_stats()
        comm = self.stage.average_grads()
        coef = 1.0
        clip = self.cfg.train["clip_norm"]
        if clip is not None and self.links:  # on the device: no host read
            coef = self._clip_coefficient(float(clip))
        elif clip is not None:  # the global norm spans every stage (and tensor slice)
            sq = np.array([self._grad_square_sum()])
            g.pipe.allreduce_inplace(sq, "sum", "pipeline gradient norm")
            coef = min(float(clip) / (math.sqrt(sq[0]) + 1e-6), 1.0)
        self.stage.apply(lr, coef)
        self.busy[g.stage] += timing.busy
        self.wall[g.stage] += timing.wall
        # Per-stage busy and idle time: the loop averages extras over all ranks, so each
        # rank puts P x its own value at its stage's index (mean = mean over replicas).
        busy, wall = np.zeros(P), np.zeros(P)
        busy[g.stage], wall[g.stage] = timing.busy * P, timing.wall * P
        extra = {"stage_busy_sec": list(busy), "stage_idle_sec": list(wall - busy)}
        if self.moe:  # every rank the same keys: zeros on stages without MoE layers
            found = self.stage.moe_metrics(timing.wall)
            experts = moe_options(self.cfg.model["moe"])["experts"]
            extra |= moe_parallel.pipeline_metrics(found, experts, P, self._moe_stages)
        if g.last and g.coord["tensor"] == 0:  # a tensor group counts its batch once
            return StepStats(loss_sum, correct, self.terms, comm, extra)
        return StepStats(0.0, 0, 0, comm, extra)

    def _clip_coefficient(self, clip: float):
        """The clip's coefficient over the process groups' links, a 0-d tensor where
        the gradients are: the split parameters' squares summed over the tensor axis,
        the replicated ones counted once (tensor rank 0), then over the stages; the
        same float64 sums and rule as the host path. Cost: two one-element allreduces,
        over a tensor group and a pipeline (T and P ranks), whatever the world size: the
        same at 1,024 and 4,096 ranks."""
        split, whole = self.stage.grad_square_sum_tensors(
            tensor_parallel.split_kind if self.tensor > 1 else (lambda name: False)
        )
        t = self.links.get("tensor")
        sq = (split + (whole if t is None or t.rank == 0 else 0.0)).reshape(1)
        if t is not None:
            t.allreduce_inplace(sq, "sum", "tensor-parallel gradient norm")
        pipe = self.links["pipe"]
        pipe.allreduce_inplace(sq, "sum", "pipeline gradient norm")
        return pipe.clip_coefficient(sq[0], clip)

    def _grad_square_sum(self) -> float:
        """This stage's squared gradient norm: split parameters' squares summed over
        the tensor axis, replicated ones (equal on every tensor rank) counted once."""
        if self.tensor == 1:
            return self.stage.grad_square_sum()
        split, whole = self.stage.grad_square_sums(tensor_parallel.split_kind)
        t = self.grid.tensor
        sq = np.array([split + (whole if t.rank == 0 else 0.0)])
        t.allreduce_inplace(sq, "sum", "tensor-parallel gradient norm")
        return float(sq[0])

    def evaluate(self, stop=None) -> np.ndarray | None:
        """Validation through the pipeline (eval mode), each replica on its own block;
        None when `stop()` says a rank was signalled. The stages run their batches
        staggered, so `stop` is asked between chunks of batches, the pipeline drained
        (engine.chunk_batches: a signal waits 8 x stages forwards at most, SLURM's 30 s
        grace included; it was acted on only after the whole evaluation)."""
        if self.dataset is None or self.dataset.val_size == 0:
            return None
        g, b = self.grid, self.cfg.train["batch_size"]
        # as many batches on every replica (iterate_val's rule): MoE layers exchange
        # tokens between replicas inside each forward
        n_batches = val_batch_count(self.dataset.val_size, g.num_replicas, b)
        batches = iterate_val(self.dataset, g.replica, g.num_replicas, b) if g.first else None
        outputs = run_inference_stoppable(
            self.stage, self.link, batches, n_batches, b, stop, chunk_batches(self.stages)
        )
        if outputs is None:
            return None
        sums = np.zeros(4)  # loss, correct, count (tokens for language models), samples
        if g.last and g.coord["tensor"] == 0:
            val = iterate_val(self.dataset, g.replica, g.num_replicas, b)
            for (_, y), logits in zip(val, outputs, strict=True):
                logits = logits[: len(y)]
                sums += (
                    cross_entropy_np(logits, y).sum(),
                    int((logits.argmax(-1) == y).sum()),
                    y.size,
                    len(y),
                )
        return sums

    def average_buffers(self) -> None:
        self.stage.average_buffers()

    # --- canonical state ------------------------------------------------------------
    def export_state(self, staged: bool = False) -> dict | None:
        """The whole model and optimizer under canonical names on rank 0 (collective).

        Replica 0's stages send their tensors and slots to rank 0; the names and layouts
        are those of a data-parallel run, so checkpoints move between the strategies.
        With tensor parallelism rank 0 joins each split tensor from its T slices.
        Cost: P x T ranks' arrays gathered to rank 0 (the model's size in bytes, received
        into arrays it owns: comm.gather_arrays), once per save.
        """
        if self.zero:  # collective over each stage's replicas; replica 0 gets the slots
            mine = self.stage.export_state()
            mine = mine if self.grid.replica == 0 else None
        elif self.moe:  # every expert from its rank of data replica 0's expert group
            experts, dense = moe_parallel.split_experts(self.stage.export_state())
            if experts and self.grid.coord["data"] == 0:
                experts = moe_parallel.gather_expert_weights(experts, self.groups.experts) or {}
            mine = {**dense, **experts} if self.grid.replica == 0 else None
        else:
            mine = self.stage.export_state() if self.grid.replica == 0 else None
        parts = self.world.gather_arrays(mine, what="gather pipeline state")
        if not self.world.is_root:
            return None
        slices: dict[str, list] = {}
        steps = []
        for part in parts:  # world order: tensor innermost, so slices arrive in order
            for k, v in (part or {}).items():
                if k == "optimizer/step":
                    steps.append(int(v))
                else:
                    slices.setdefault(k, []).append(v)
        del parts, mine
        merged = {}  # each tensor's slices freed as it is joined: one copy held at a time
        for k in list(slices):
            v = slices.pop(k)
            merged[k] = tensor_parallel.unshard(k.rsplit("/", 1)[-1], v) if len(v) > 1 else v[0]
        state = {f"model/{k}": merged[f"model/{k}"] for k in self.canonical_names}
        for key in sorted(k for k in merged if k.startswith("optimizer/")):
            state[key] = merged[key]
        if steps:  # every stage steps once per optimizer step: all equal
            state["optimizer/step"] = np.array(max(steps), dtype=np.int64)
        return state

    def export_pieces(self, min_bytes: int) -> dict | None:
        """Replica 0's stages write the tensors they own, whole, or with tensor
        parallelism each tensor rank its slices of the split ones (("tensor", rank, T)
        pieces) and tensor rank 0 the replicated rest; under ZeRO every replica writes
        its own ranges of its stage's optimizer state (of its slices: ("tensor", rank,
        T, first)); the optimizer step (equal on every stage) is rank 0's."""
        t = self.grid.tensor
        pieces = {}
        if self.zero:
            state, owned = self.stage.export_owned()
            for k, (shape, first, elements) in owned.items():
                piece = tensor_parallel.range_piece(k, shape, first, elements, t.size, t.rank)
                if piece is not None:
                    pieces[k] = piece
            if self.grid.replica != 0:
                return pieces
        elif self.moe:  # each expert written by its rank (its copies share it out)
            experts, state = moe_parallel.split_experts(self.stage.export_state())
            d = self.grid.data
            pieces.update(split_replicated(experts, d.rank, d.size, min_bytes))
            if self.grid.replica != 0:
                return pieces
        elif self.grid.replica != 0:
            return {}
        else:
            state = self.stage.export_state()
        step = state.pop("optimizer/step", None)
        for k, v in state.items():
            piece = tensor_parallel.slice_piece(k, v, t.size, t.rank)
            if piece is not None:
                pieces[k] = piece
            elif t.rank == 0:
                pieces[k] = (np.shape(v), 0, np.asarray(v).reshape(-1))
        if step is not None and self.world.is_root:
            pieces["optimizer/step"] = ((), 0, np.asarray(step).reshape(-1))
        return pieces

    def import_state(self, ckpt) -> None:
        self.stage.import_state(self._shard(ckpt.state))

    def get_weights(self) -> dict | None:
        """The whole model under canonical names on rank 0 (collective; None elsewhere)."""
        state = self.export_state()
        return None if state is None else {k[6:]: v for k, v in state.items() if k[:6] == "model/"}

    def set_weights(self, weights: dict) -> None:
        """Load a full canonical dict (every rank passes it; each takes its stage's part)."""
        self.stage.set_weights(self._shard(weights))

    def weight_shapes(self) -> dict[str, tuple]:
        return dict(self.canonical_shapes)

    def rng_state(self) -> dict[str, np.ndarray]:
        return self.stage.rng_state()

    def set_rng_state(self, state: dict[str, np.ndarray]) -> None:
        self.stage.set_rng_state(state)

    def checkpoint_attrs(self) -> dict:
        return {
            **versions(self.cfg.backend),
            "strategy": "pipeline",
            "pipeline_stages": self.stages,
        }

    def summary(self, ctx, summary: dict) -> dict:
        w, g = self.world, self.grid
        peaks = np.zeros(self.stages, dtype=np.int64)
        peaks[g.stage] = self.stage.peak_stash
        peaks = w.allreduce_array(peaks, "max", "pipeline peak stash")
        # each stage's largest rank (replicas, tensor ranks): its measured peak, and its
        # plan (-1: not planned: TensorFlow, a user's model), in one allreduce
        memory = np.full((2, self.stages), -1.0)
        memory[0, g.stage], measured = self.stage.peak_memory()
        memory[1, g.stage] = self._planned_peak()
        memory, plan = w.allreduce_array(memory, "max", "pipeline peak and planned memory")
        busy = w.allreduce_array(self.busy, "sum", "pipeline stage times") / g.num_replicas
        wall = w.allreduce_array(self.wall, "sum", "pipeline stage times") / g.num_replicas
        return {
            **summary,
            "stages": self.stages,
            "tensor": self.tensor,
            "replicas": g.num_replicas,
            "schedule": self.cfg.pipeline["schedule"],
            "microbatches": self.micro,
            "partition": self.counts,
            "engine": self.engine,
            "stage_busy_sec": [float(v) for v in busy],
            "stage_idle_sec": [float(v) for v in wall - busy],
            "bubble_fraction": float(np.mean(1 - busy / np.maximum(wall, 1e-12))),
            "bubble_theory": bubble_theory(self.stages, self.micro),
            "stage_peak_microbatches": [int(v) for v in peaks],
            "stage_peak_memory_mib": [round(float(v) / 2**20, 1) for v in memory],
            "stage_peak_memory_of": measured,  # the same on every rank (one device kind)
            "stage_plan_memory_mib": [round(float(v) / 2**20, 1) if v >= 0 else None for v in plan],
        }

    def _planned_peak(self) -> float:
        """The memory plan's peak of this rank (the figure stage_peak_memory_mib
        measures: with the baseline on a CPU rank, the CUDA allocator's terms on a GPU
        rank), -1 where the stage was not planned."""
        if self.planned is None:
            return -1.0
        terms, baseline = self.planned
        on_gpu = getattr(self.stage, "on", None) is not None and self.stage.on.type == "cuda"
        return terms["total"] + (0.0 if on_gpu else baseline)

    def rank_name(self, index: int) -> str:
        c = self.grid.shape.coords(index)
        split = f", tensor {c['tensor']}" if self.tensor > 1 else ""
        replica = c["data"] * self.grid.shape.expert + c["expert"]  # as grid.replica
        return f"rank {index} (stage {c['pipe']}{split}, replica {replica})"
