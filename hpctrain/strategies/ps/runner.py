"""`strategy: parameter_server`: roles, data, the serving ranks, the final report.

The last `ps.servers` ranks become servers and the rest workers (one split). Every rank
derives the same shard plan from the zoo's canonical parameter names and shapes;
servers start from the zoo's numpy initial weights, so no framework is loaded on them.
Worker w reads exactly the rows data-parallel rank w of a `workers`-rank job reads (the
same `ShardedTrainData`), which is what makes sync mode comparable with allreduce
training step for step.

Workers run the one training loop (hpctrain/loop.py): a step is one push/pull round
(worker.py). Servers run `serve()` (server.py) until every worker is done. In sync mode
the workers' step reports are reduced over the workers (NaN stop, metrics), and a
checkpoint or preemption decision travels in the push and reply headers
(protocol.py), so servers and workers save at the same step; async/bounded workers
report alone, save on the policy when server 0 has stopped every worker after a step of
its own (server.py), and at the end and when preempted. At the end the servers broadcast
their shards, the workers evaluate, and rank 0 (worker 0) writes the checkpoint.

Checkpoints use the data-parallel names and layout, so a PS checkpoint continues as
data-parallel training and back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from ...backends import versions, worker_class
from ...backends.base import OPTIMIZER_SLOTS, StepStats
from ...backends.gradient_engine import average_array, join_words
from ...backends.horovod_env import keys_set
from ...data import (
    ShardedTrainData,
    batch_problem,
    iterate_val,
    prepare_dataset,
    val_batch_count,
)
from ...errors import CheckpointError, ConfigError, DataError
from ...models import zoo
from ...runtime import p2p
from ...runtime.grid import ProcessGrid
from ...shape import JobShape
from ..base import RunEnd, StrategyBase
from ..startup import settings_text
from . import protocol as P
from .report import report
from .server import Server
from .sharding import plan_shards
from .worker import Worker

log = logging.getLogger("hpctrain.ps")


def config_problems(cfg, world_size: int) -> str | None:
    """What makes this configuration impossible for the parameter server in a job of
    `world_size` ranks (or None). The rest (clip_norm, compression, zoo models...) the
    config refused before any rank started: strategies/composition.parameter_server."""
    servers = cfg.ps["servers"]
    if not JobShape.of(cfg, world_size).tiles:
        return (
            f"ps.servers={servers} leaves no worker in a job of {world_size} rank(s): "
            f"launch more ranks than servers (e.g. mpirun -np {servers + 2})"
        )
    return None


POSITION_KEYS = ("step", "epoch", "position")


class ParameterServer(StrategyBase):
    """Workers train under the loop; servers serve. See the module docstring."""

    def __init__(self, cfg, world, run_dir, threads: int):
        super().__init__(cfg, world, run_dir, threads)
        w = world
        w.agree(config_problems(cfg, w.size), error_type=ConfigError)
        self.grid = ProcessGrid(w)
        shape = JobShape.of(cfg, w.size)
        self.n_servers, self.n_workers = shape.servers, shape.replicas
        self.is_server = self.serves = w.rank >= self.n_workers
        self.index = w.rank - self.n_workers if self.is_server else w.rank
        self.server_ranks = list(range(self.n_workers, w.size))
        # the name fixes the partition (the split is cached by name for the process)
        self.role = w.guarded_split(
            f"ps.role.{self.n_workers}+{self.n_servers}", int(self.is_server)
        )
        self.dataset = prepare_dataset(cfg, w, run_dir)
        inp = self.dataset.input_spec
        tcfg = cfg.train
        layers = zoo.build_layers(cfg.model, inp)
        init = zoo.init_weights(layers, tcfg["seed"])
        self.shapes = OrderedDict((n, init[n].shape) for n in zoo.param_names(layers))
        # every tensor a data-parallel checkpoint holds (parameters and buffers), in order
        self.model_shapes = OrderedDict((k, tuple(v.shape)) for k, v in init.items())
        self.plan = plan_shards(self.shapes, self.n_servers, cfg.ps["chunk_bytes"])
        global_batch = shape.global_batch(tcfg["batch_size"], tcfg["grad_accum"])
        self._steps_per_epoch = self.dataset.train_size // global_batch
        problem = batch_problem(
            self.dataset, self.n_workers, tcfg["batch_size"], tcfg["grad_accum"], "train.grad_accum"
        )
        w.agree(problem, error_type=DataError)
        self.sync = cfg.ps["mode"] == "sync"
        self.report_comm = self.role if (self.sync and not self.is_server) else None
        self.lr_replicas = self.n_workers
        self.model = self.data = self.worker = self.server = None
        self.model_buffers, self._meta, self.start = {}, {}, (0, 0, 0)
        self._positions: dict[int, tuple] = {}  # rank 0: each worker's (async), last save
        self._finished = False  # async: `finish` gathered the positions the end saves
        error = None
        if self.is_server:
            flat = np.zeros(self.plan.server_size(self.index), np.float32)
            self.params = self.plan.gather(self.index, init, flat)
            self.server_state = None
        else:
            backends = cfg.ps["backends"] or [cfg.backend]
            self.backend = backends[self.index % len(backends)]
            self.model = worker_class(self.backend)(cfg, inp, threads, w.rank)
            if dict(self.model.param_shapes()) != dict(self.shapes):
                error = f"{self.backend} model's parameters differ from the zoo's layout"
            self.data = ShardedTrainData(
                self.dataset, self.index, self.n_workers, tcfg["batch_size"],
                tcfg["grad_accum"], tcfg["seed"], cfg.data["prefetch"],
                in_memory_bytes=int(cfg.data["in_memory_mb"] * (1 << 20)),
                node_group=self.role,  # the workers: one copy per node
            )  # fmt: skip
            self.agreed_flags = lambda _stats: self.worker.flags()
        w.agree(error)

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def describe(self) -> str:
        return (
            f"parameter server ({self.cfg.ps['mode']}): {self.n_servers} server(s), "
            f"{self.n_workers} worker(s), {len(self.shapes)} tensors in "
            f"{len(self.plan.chunks)} chunks, model {self.cfg.model['name']}, gradients "
            f"pushed to the servers as float32, {settings_text(self.cfg)}"
        )

    def grid_text(self) -> str:
        """Workers and servers, not the grid's one data axis over every rank: a worker
        is a replica, a server holds a shard of the parameters."""
        return f"{self.n_workers} worker(s) + {self.n_servers} server(s)"

    def layout_warnings(self) -> list[str]:
        t, out = self.cfg.train, []
        ignored = [
            what
            for what, on in (
                (f"train.allreduce={t['allreduce']}", t["allreduce"] != "auto"),
                ("train.hierarchical", t["hierarchical"]),
            )
            if on
        ]
        ignored += keys_set(self.cfg.horovod)
        if ignored:
            out.append(
                f"{join_words(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with "
                "the parameter server: workers push their gradients to the servers, no "
                "allreduce averages them"
            )
        listed = self.cfg.ps["backends"] or []
        unused = [b for b in listed[self.n_workers :] if b not in listed[: self.n_workers]]
        if unused:
            out.append(
                f"ps.backends lists {', '.join(listed)} but {self.n_workers} worker(s) take "
                f"the first {self.n_workers}: {', '.join(unused)} trains nowhere; launch "
                f"{len(listed) + self.n_servers} ranks to use every backend listed"
            )
        return out

    def lr_of(self, version: int) -> float:
        """Sync: one version per global step; async/bounded: one per worker push."""
        schedule = self.ctx.schedule  # lr_schedule.Schedule (optimizer.resume_schedule)
        if self.sync:
            return schedule.lr(version, self.n_workers)
        return schedule.lr(version // self.n_workers, 1)

    # --- workers ------------------------------------------------------------------------
    def batches(self, epoch: int, position: int):
        if self.worker is None:
            self._start_worker()
        return self.data.iterate(epoch, position)

    def _start_worker(self) -> None:
        ctx = self.ctx
        policy = ctx.checkpoints.policy

        def wants_save(step: int, epoch_end: bool) -> bool:
            """Sync: every worker's view (the same step). Async: worker 0's own steps
            ask for a save (server.py), none at its last step: the end saves."""
            if not self.sync and (self.index != 0 or step >= ctx.total_steps):
                return False
            return policy.due(step, epoch_end=epoch_end)

        self.worker = Worker(
            self.world, self.index, self.server_ranks, self.plan, self.model, self.data,
            self.cfg, start_step=ctx.state.step, position=ctx.state.position,
            wants_save=wants_save, preemption=ctx.pre, faults=ctx.faults,
        )  # fmt: skip
        self.worker.start()

    def step(self, batch, lr: float, tally: bool = True) -> StepStats:
        # counts on every step: an async worker's steps are not the loop's logged ones
        loss_sum, correct, count, wait = self.worker.step(batch)
        return StepStats(loss_sum, correct, count, wait)

    def on_preempt(self, ctx) -> str:
        return "preempted"  # every worker stops; `finish` saves with the servers

    def evaluate(self, stop=None) -> np.ndarray | None:
        """Validation on the workers' final parameters (called by `finish` only); None
        when `stop()` says a rank was signalled. It is a collective of every rank, asked
        once per batch, so the servers, which evaluate nothing, step through as many
        batches as a worker: a signal during a long evaluation (SLURM's 30 s before
        SIGKILL) stops it within a batch, and the final save follows."""
        sums = np.zeros(4)  # loss, correct, count (tokens for language models), samples
        batch = max(256, self.cfg.train["batch_size"])
        batches = (
            None if self.is_server else iterate_val(self.dataset, self.index, self.n_workers, batch)
        )
        for _ in range(val_batch_count(self.dataset.val_size, self.n_workers, batch)):
            if stop is not None and stop():
                return None
            if batches is not None:
                x, y = next(batches)
                ev = self.model.evaluate(x, y)
                sums += (ev.loss_sum, ev.correct, ev.count, len(y))
        return sums

    evaluates_in_loop = False  # servers are busy serving; evaluation is in `finish`

    def average_buffers(self) -> None:
        """Workers average their BatchNorm buffers over the workers (servers: nothing)."""
        if self.is_server:
            return
        buffers = self.model.get_buffers()
        for name, v in buffers.items():
            average_array(self.role, v, f"parameter server: average buffer {name}")
        if buffers:
            self.model.set_buffers(buffers)
        self.model_buffers = buffers

    # --- servers -------------------------------------------------------------------------
    def serve(self, ctx) -> None:
        self.server = Server(
            self.world, self.index, list(range(self.n_workers)), self.params, self.cfg,
            self.lr_of, preemption=ctx.pre,
            on_checkpoint=lambda srv: ctx.checkpoints.maybe_save(srv.version, agreed_due=True),
            servers=self.server_ranks,
        )  # fmt: skip
        if self.server_state is not None:
            self.server.opt.load(self.server_state["opt"])
            self.server.version = self.server_state["version"]
        self.stats = self.server.run()

    # --- the end -------------------------------------------------------------------------
    def finish(self, ctx) -> RunEnd:
        """Every rank: the final parameters, evaluation and statistics, agreed for the
        loop to apply (a preemption checkpoints there, through the shared code)."""
        w = self.world
        if not self.is_server:
            self.stats = self.worker.stop()
        self._wait_for_every_rank_to_finish()
        preempted = w.any_flag(ctx.preempted() or ctx.pre.requested, "agree on preemption")
        self._final_weights()
        result = {} if preempted else ctx.evaluate()
        # with the statistics, each worker's step and samples: asynchronous workers stop
        # at their own, and the checkpoint keeps each one's, so that a resume neither
        # repeats nor skips a worker's samples (3 integers a worker in the gather: ~100
        # KB more on rank 0 at 1,024 workers, ~400 KB at 4,096)
        spot = self._own_spot()
        gathered = w.gather_object((self.stats, spot), what="parameter server statistics")
        self._finished = True  # from here the loop's step is the agreed last one
        everyone = [stats for stats, _ in gathered] if gathered is not None else None
        self._positions = {i: p for i, (_, p) in enumerate(gathered or []) if p is not None}
        self._ps_summary, final = None, None
        if w.is_root:
            workers = [s for s in everyone if "worker" in s]
            facts = {
                "mode": self.cfg.ps["mode"], "servers": self.n_servers,
                "workers": self.n_workers, "world_size": w.size,
                "model": self.cfg.model["name"], "steps": ctx.total_steps,
            }  # fmt: skip
            elapsed = ctx.elapsed()
            self._ps_summary = report(ctx.metrics, facts, everyone, result, elapsed)
            final = (max(s["steps"] for s in workers), ctx.state.epoch, ctx.state.position)
        step, epoch, position = w.bcast_object(final, what="agree on the final step")
        return RunEnd(step, epoch, position, dict(result), preempted, label="preempted")

    def _own_spot(self) -> tuple[int, int, int] | None:
        st = self.ctx.state
        return None if self.is_server else (st.step, st.epoch, st.position)

    def _wait_for_every_rank_to_finish(self) -> None:
        """Finished ranks (and a silenced worker) wait here without spinning. In sync
        mode every worker ends at the same version: a rank that does not finish within
        the collective timeout is named. Async and bounded workers end at their own pace
        (what the modes are for: a worker 10 minutes slower than the fastest failed the
        job here), so the wait has no deadline of its own while every rank answers the
        watchdog's liveness probe, asked every collective timeout: a stopped or lost rank
        (a worker the servers dropped and that never came back) is named then."""
        w = self.world
        barrier = [w.comm.Ibarrier()]
        if self.cfg.ps["mode"] == "sync":
            what = f"parameter server: rank {w.rank} finished and waits for the others"
            p2p.wait_or_abort(
                w, barrier, what, "a rank still training or serving", backoff=P.Backoff(0.01)
            )
            return
        what = "parameter server: the finished ranks wait for those still training"
        p2p.wait_while_every_rank_answers(w, barrier, what, P.Backoff(0.01))

    def _final_weights(self) -> None:
        """Every server broadcasts its shard; workers load the full parameters."""
        w = self.world
        full = {k: np.zeros(v, np.float32) for k, v in self.shapes.items()}
        for s, root in enumerate(self.server_ranks):
            buf = (
                self.params
                if self.index == s and self.is_server
                else np.empty(self.plan.server_size(s), np.float32)
            )
            w.bcast_inplace(buf, root=root, what="parameter server: final parameters")
            self.plan.scatter(s, buf, full)
        self.average_buffers()  # BatchNorm statistics stay per worker until here
        if not self.is_server:
            self.model.set_params(full)
            self.final_weights = {**full, **self.model_buffers}

    def summary(self, ctx, summary: dict) -> dict:
        if self._ps_summary is None:
            return summary
        return {**summary, **self._ps_summary}

    # --- checkpoints ---------------------------------------------------------------------
    @property
    def checkpoint_world(self) -> int:
        """The data-parallel equivalent: worker w reads what DP rank w of n_workers reads."""
        return self.n_workers

    def weight_shapes(self) -> dict[str, tuple]:
        return dict(self.model_shapes)

    def rng_state(self) -> dict[str, np.ndarray]:
        return {} if self.is_server else self.model.rng_state()

    def set_rng_state(self, state: dict[str, np.ndarray]) -> None:
        if not self.is_server:
            self.model.set_rng_state(state)

    def checkpoint_attrs(self) -> dict:
        return {
            **versions(self.cfg.backend),
            "strategy": "parameter_server",
            "ps_mode": self.cfg.ps["mode"],
            "ps_servers": self.n_servers,
            "ps_workers": self.n_workers,
        }

    def rank_name(self, index: int) -> str:
        return f"worker {index} (rank {index})"

    def export_state(self, staged: bool = False) -> dict | None:
        """Every rank: each server sends its shard (parameters, slots, version) to rank 0,
        which assembles the canonical model and optimizer (collective over the world).

        Cost: rank 0 receives one message per server tensor slice: O(model bytes), not
        O(workers); at 1,024 or 4,096 ranks with S servers it is S x (1 + slots) receives.
        An async save before the end also gathers each worker's (step, epoch, position):
        ~100 KB on rank 0 at 1,024 workers, ~400 KB at 4,096, as `finish` does.
        """
        w = self.world
        slot_names = OPTIMIZER_SLOTS[self.cfg.optimizer["name"]]
        full = {k: np.zeros(v, np.float32) for k, v in self.shapes.items()}
        slots = {
            n: {k: np.zeros(v, np.float32) for k, v in self.shapes.items()} for n in slot_names
        }
        meta = {}
        if not self.sync and not self._finished:  # each async worker saves at its own step
            spots = w.gather_object(self._own_spot(), what="parameter server: positions")
            self._positions = {i: p for i, p in enumerate(spots or []) if p is not None}
        tag = P.TAG_CTRL + 100
        # one guard every rank enters (the watchdog counts guards per rank)
        with w.watchdog.guard("parameter server: gather shards for a checkpoint"):
            for s, root in enumerate(self.server_ranks):
                if self.is_server and self.index == s:
                    opt = self.server.opt
                    info = np.array([self.server.version, opt.step], np.int64)
                    w.comm.Send(info, dest=0, tag=tag)
                    w.comm.Send(self.params, dest=0, tag=tag)
                    for n in slot_names:
                        w.comm.Send(opt.slots[n], dest=0, tag=tag)
                elif w.is_root:
                    info = np.empty(2, np.int64)
                    buf = np.empty(self.plan.server_size(s), np.float32)
                    w.comm.Recv(info, source=root, tag=tag)
                    w.comm.Recv(buf, source=root, tag=tag)
                    self.plan.scatter(s, buf, full)
                    for n in slot_names:
                        w.comm.Recv(buf, source=root, tag=tag)
                        self.plan.scatter(s, buf, slots[n])
                    meta[s] = (int(info[0]), int(info[1]))
        if not w.is_root:
            return None
        model = {**full, **self.model_buffers}
        state = {f"model/{k}": model[k] for k in self.model_shapes}
        for n in slot_names:
            state.update({f"optimizer/{n}/{k}": v for k, v in slots[n].items()})
        if self.cfg.optimizer["name"] == "adam":
            state["optimizer/step"] = np.array(max(u for _, u in meta.values()), np.int64)
        self._meta = meta
        return state

    def trainer_extras(self) -> dict:
        extras = {}
        for s, (version, updates) in sorted(self._meta.items()):
            extras[f"ps_version_{s}"] = version
            extras[f"ps_updates_{s}"] = updates
        for i, where in sorted(self._positions.items()):
            for key, value in zip(POSITION_KEYS, where, strict=True):
                extras[f"ps_worker_{key}_{i}"] = value
        return extras

    def own_position(self, ckpt) -> tuple[int, int, int] | None:
        """An async/bounded worker's own (step, epoch, position) from a checkpoint that
        holds each worker's (with the same number of workers); else the checkpoint's:
        sync workers all start at its step (they share every step from there)."""
        tr = ckpt.trainer
        keys = [f"ps_worker_{key}_{self.index}" for key in POSITION_KEYS]
        same = int(ckpt.attrs.get("ps_workers", -1)) == self.n_workers
        if self.is_server or self.sync or not same or any(k not in tr for k in keys):
            return None
        return tuple(int(tr[k]) for k in keys)

    def _version_from(self, ckpt, step: int) -> int:
        """The version this server resumes at, in its mode's units (`lr_of`): sync counts
        steps, async and bounded updates (about `workers` a step). A checkpoint of the
        other kind (data parallel, or the parameter server in the other mode) gives its
        step in those units."""
        key, mode = f"ps_version_{self.index}", ckpt.attrs.get("ps_mode")
        if mode is not None and (mode == "sync") == self.sync and key in ckpt.trainer:
            return int(ckpt.trainer[key])
        return step if self.sync else step * self.n_workers

    def import_state(self, ckpt) -> None:
        """Servers take their shard of parameters, slots and version; workers their
        buffers (the loop restores the data position and random state)."""
        tr = ckpt.trainer
        self.start = (int(tr["step"]), int(tr["epoch"]), int(tr["position"]))
        weights = ckpt.model_weights()
        kind = self.cfg.optimizer["name"]
        if self.is_server:
            slot_names = OPTIMIZER_SLOTS[kind]
            absent = [
                f"optimizer/{n}/..."
                for n in slot_names
                if any(f"optimizer/{n}/{k}" not in ckpt.state for k in self.shapes)
            ]
            if absent:
                raise CheckpointError(
                    f"{ckpt.path}: optimizer state {', '.join(absent)} missing (saved with "
                    f"another optimizer than optimizer.name={kind}?)"
                )
            self.plan.gather(self.index, weights, self.params)
            size = self.plan.server_size(self.index)
            opt = {
                n: self.plan.gather(
                    self.index,
                    {k: ckpt.state[f"optimizer/{n}/{k}"] for k in self.shapes},
                    np.zeros(size, np.float32),
                )
                for n in slot_names
            }
            step = self.start[0]
            updates = tr.get(f"ps_updates_{self.index}")
            if updates is None:  # a data-parallel checkpoint: one update per step
                updates = int(ckpt.state.get("optimizer/step", step))
            opt["step"] = np.array(int(updates), np.int64)
            self.server_state = {"opt": opt, "version": self._version_from(ckpt, step)}
        else:
            buffers = {k: weights[k] for k in self.model.get_buffers()}
            if buffers:
                self.model.set_buffers(buffers)
