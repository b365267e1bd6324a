"""The interface every strategy offers the training loop, and what they share.

A strategy decides how the job's ranks share the work: it lays out the process grid,
builds the data and the framework parts on each rank, trains one step, evaluates, and
moves its state to and from the canonical checkpoint layout (`/model/<name>`,
`/optimizer/<slot>/<name>`), so checkpoints move between strategies. The loop
(hpctrain/loop.py) never asks which strategy it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..backends.base import StepStats
from ..data import (
    BenchmarkData,
    ShardedTrainData,
    batch_problem,
    benchmark_input_spec,
    prepare_dataset,
)
from ..errors import DataError
from ..runtime.comm import GuardedComm
from ..runtime.grid import ProcessGrid


@dataclass(frozen=True)
class RunContext:
    """What a strategy may use of the run, handed over by the loop (`begin`, then each
    hook): read the position, schedule and flags, save or checkpoint through the session,
    write metrics. Nothing of the loop is written through it: results come back as
    return values (`RunEnd`, a signal's name)."""

    state: object  # TrainState: step, epoch, position (read only)
    total_steps: int
    elapsed: Callable[[], float]  # seconds since `fit` started, a suspension left out
    schedule: object  # lr_schedule.Schedule: lr(step, replicas)
    pre: object  # runtime.preemption.Preemption
    faults: object  # runtime.faults.Faults (none outside tests)
    checkpoints: object  # checkpoint.session.RunCheckpoints: policy, maybe_save, preempt
    metrics: object  # MetricsWriter
    progress: object  # the rank-0 progress display
    evaluate: Callable[[], dict]  # collective validation over every rank
    preempted: Callable[[], bool]  # whether a signal stopped the training loop


@dataclass(frozen=True)
class RunEnd:
    """What a strategy's `finish` agreed at the end of a run, for the loop to apply (the
    strategy writes no loop state): the position every rank ends at, the final
    evaluation, and whether a signal stopped the run (the loop then checkpoints through
    the shared preemption code, with `label` in its message)."""

    step: int
    epoch: int
    position: int
    metrics: dict = field(default_factory=dict)
    preempted: bool = False
    label: str = ""


class Strategy(Protocol):
    """What the loop calls. Collective methods are called by every rank of the job."""

    grid: ProcessGrid
    data: object | None  # ShardedTrainData / BenchmarkData; None on ranks that serve
    steps_per_epoch: int
    lr_replicas: int  # replicas the learning-rate scaling counts
    report_comm: GuardedComm | None  # ranks whose step reports are summed; None: alone
    # True: every report_comm rank's step sums are read one step late (GPU ranks, whose
    # sums stay on the device); one value for the job, whatever a rank's stats hold
    step_sums_on_device: bool
    serves: bool  # True on ranks that run `serve` instead of training
    agreed_flags: object | None  # callable(stats) -> flags, for strategies that agree
    evaluates_in_loop: bool  # False: evaluation happens in `finish` only
    checkpoint_world: int  # the data-parallel world size a checkpoint corresponds to

    def describe(self) -> str: ...  # the startup line: strategy, engine, ZeRO, precision
    def grid_text(self) -> str: ...  # the process grid, as the startup line states it
    def layout_warnings(self) -> list[str]: ...  # settings this layout makes a no-op
    def batches(self, epoch: int, position: int): ...
    def step(self, batch, lr: float, tally: bool = True) -> StepStats: ...
    # tally: count correct predictions (the loop asks on the steps it logs; a strategy
    # may count on every step where that is free: Backend.train_step says why)
    # local (loss_sum, correct, count, samples): count is what loss and accuracy are per
    # (tokens for language models), samples the sequences or images
    # stop(): called once per validation batch on every rank (collective); True ends
    # the evaluation (None): a signal is acted on within a batch (data parallel)
    def evaluate(self, stop=None) -> np.ndarray | None: ...
    def average_buffers(self) -> None: ...  # collective
    # collective; the canonical state on rank 0, valid until the next step: arrays may
    # be views of live tensors (an async checkpoint copies those, keeps fresh ones).
    # staged=True (an async save's, on rank 0): arrays may still be filling until
    # `wait_exported()` returns (a GPU rank's copy beside the next step)
    def export_state(self, staged: bool = False) -> dict | None: ...
    def wait_exported(self) -> None: ...
    def export_pieces(self, min_bytes: int) -> dict | None: ...  # local; None: gather
    # True: rank 0's exported arrays stay unchanged until `fence()`, which the strategy
    # calls before it changes them (an async save copies them during the next step)
    def hold_exported_state(self, fence) -> bool: ...
    def import_state(self, ckpt) -> None: ...
    def weight_shapes(self) -> dict[str, tuple]: ...  # the whole canonical model
    def rng_state(self) -> dict[str, np.ndarray]: ...
    def set_rng_state(self, state: dict[str, np.ndarray]) -> None: ...
    def checkpoint_attrs(self) -> dict: ...
    def rank_state(self) -> dict[str, np.ndarray]: ...  # this rank's private memory
    def load_rank_state(self, arrays: dict[str, np.ndarray]) -> None: ...
    def trainer_extras(self) -> dict: ...  # strategy facts for the checkpoint's trainer state
    def own_position(self, ckpt) -> tuple[int, int, int] | None: ...  # this rank's (below)
    def begin(self, ctx: RunContext) -> None: ...  # before training or serving
    def serve(self, ctx: RunContext) -> None: ...
    def finish(self, ctx: RunContext) -> RunEnd | None: ...  # collective, at the end
    def on_preempt(self, ctx: RunContext) -> str: ...  # collective; the signal's name
    def save_now(self, ctx: RunContext) -> None: ...  # collective; an agreed checkpoint
    def summary(self, ctx: RunContext, summary: dict) -> dict: ...  # collective
    def release(self) -> None: ...  # collective, after a finished run: shared memory freed
    def rank_name(self, index: int) -> str: ...  # a report_comm rank, for messages


def on_gpu(part) -> bool:
    """Whether a backend or stage computes on a GPU (TensorFlow's and host parts have no
    torch device: False). The device is agreed by every rank (backends/torch_device.py)."""
    return getattr(getattr(part, "device", None), "type", "cpu") == "cuda"


class StrategyBase:
    """Defaults for strategies whose every rank trains and agrees through step reports."""

    serves = False
    agreed_flags = None
    step_sums_on_device = False

    def __init__(self, cfg, world, run_dir, threads: int):
        self.cfg, self.world, self.run_dir, self.threads = cfg, world, run_dir, threads

    # --- data -----------------------------------------------------------------------
    def build_data(
        self, shard: int, shards: int, accum: int, prefetch: bool = True, accum_key=None
    ):
        """(dataset or None, train data, input spec) for data shard `shard` of `shards`;
        `accum`: micro-batches per step (`accum_key` names the setting in errors)."""
        cfg, tcfg = self.cfg, self.cfg.train
        b = tcfg["batch_size"]
        if cfg.data["source"] == "benchmark":
            inp = benchmark_input_spec(cfg.data)
            steps = max(1, cfg.data["train_samples"] // (b * accum * shards))
            return None, BenchmarkData(inp, b, accum, shards, tcfg["seed"] + shard, steps), inp
        dataset = prepare_dataset(cfg, self.world, self.run_dir)
        key = accum_key or "train.grad_accum"
        self.world.agree(batch_problem(dataset, shards, b, accum, key), error_type=DataError)
        data = ShardedTrainData(
            dataset,
            shard,
            shards,
            b,
            accum,
            tcfg["seed"],
            cfg.data["prefetch"] if prefetch else 0,
            in_memory_bytes=int(cfg.data["in_memory_mb"] * (1 << 20)),
            node_group=self.world,  # every rank reads: one copy per node
            accum_key=key,
        )
        return dataset, data, dataset.input_spec

    @property
    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch

    def batches(self, epoch: int, position: int):
        return self.data.iterate(epoch, position)

    evaluates_in_loop = True  # False: the strategy evaluates in `finish` only

    def grid_text(self) -> str:
        return self.grid.describe()

    def layout_warnings(self) -> list[str]:
        return []

    @property
    def checkpoint_world(self) -> int:
        """The data-parallel world size a checkpoint of this run corresponds to."""
        return self.world.size

    def trainer_extras(self) -> dict:
        return {}

    def own_position(self, ckpt) -> tuple[int, int, int] | None:
        """(step, epoch, position) of this rank where it differs from the checkpoint's
        (asynchronous workers); None: the checkpoint's, as every rank's."""
        return None

    def hold_exported_state(self, fence) -> bool:
        """False: an async save copies the exported arrays before the loop goes on."""
        return False

    def wait_exported(self) -> None:
        """Nothing to wait for: export_state's arrays hold their values on return (its
        `staged` is a wish a strategy may ignore)."""

    def export_pieces(self, min_bytes: int) -> dict | None:
        """This rank's part of the canonical state for a sharded checkpoint
        (checkpoint/sharded.py), without communication; None on every rank alike where
        the strategy gathers its state onto rank 0 instead."""
        return None

    def rank_state(self) -> dict[str, np.ndarray]:
        """Arrays that are this rank's alone and that a bit-exact resume needs (error-
        feedback residuals), saved one file per rank; {} on every rank alike for none."""
        return {}

    def load_rank_state(self, arrays: dict[str, np.ndarray]) -> None:
        return None

    # --- the loop's hooks ---------------------------------------------------------------
    ctx: RunContext | None = None

    def begin(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def finish(self, ctx: RunContext) -> RunEnd | None:
        return None

    def on_preempt(self, ctx: RunContext) -> str:
        return ctx.checkpoints.preempt(ctx.pre, ctx.progress)

    def save_now(self, ctx: RunContext) -> None:
        ctx.checkpoints.maybe_save(ctx.state.step, agreed_due=True)

    def serve(self, ctx: RunContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no serving ranks")

    def summary(self, ctx: RunContext, summary: dict) -> dict:
        return summary

    def release(self) -> None:
        """Free the node's shared copy of the data (collective over the ranks that read
        it; a run that fails leaves it to the process's end)."""
        if self.data is not None:
            self.data.close()

    def rank_name(self, index: int) -> str:
        return f"rank {index}"
