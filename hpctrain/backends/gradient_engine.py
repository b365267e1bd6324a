"""Who averages the gradients: Horovod's engine, or one MPI allreduce on the compute thread.

Why two: Horovod runs a background thread that negotiates with the other ranks every
cycle (1 ms), even when idle, and starts each allreduce at the next cycle. With a spare
core that thread is free and its overlap of communication with backward wins, most of all
across nodes. When every core of the node runs a compute thread there is no spare core:
the thread takes 4-6% of each core from compute, and a synchronous `MPI_Allreduce` of one
flat buffer after backward is faster (np=2 on 2 cores, torch cnn: 91% vs 96% weak-scaling
efficiency, 1.07 vs 0.43 ms added per step; `make bench`, ablation). `auto` picks by that
rule.

Framework-free: both backends call `choose` and use `FlatMean` for the MPI engine.
"""

from __future__ import annotations

import importlib
import os

import numpy as np

from ..errors import ConfigError
from ..exchange import DenseMean
from ..runtime.devices import exchange_features, mpi_only_features

ENGINES = ("auto", "horovod", "mpi", "overlap", "nccl", "gloo")
PROCESS_GROUP_ENGINES = ("nccl", "gloo")


def choose(
    cfg,
    local_ranks: int,
    threads: int,
    cores: int | None = None,
    world=None,
    device: str = "cpu",
    gpu_shared: bool = False,
) -> tuple[str, str]:
    """(engine, why) for `train.allreduce`, resolving `auto` the same way on every rank.

    Nodes can differ (cores, ranks per node): `auto` picks mpi when any node is full, agreed
    through `world`, so no rank waits in an MPI allreduce while another runs Horovod.
    GPU ranks (device "cuda", the same on every rank): `auto` is NCCL, unless ranks share
    a GPU (`gpu_shared`, agreed by the caller), which only the host-staged engines allow
    (mpi, or gloo for what runs on a process group's buffers, as the pipeline's links).
    """
    wanted = cfg.train["allreduce"]  # what it cannot carry: strategies/composition
    compression = cfg.train["compression"]
    if wanted == "horovod":  # agreed: a node without it is named on every rank
        problem = horovod_problem(cfg.backend)
        problem = problem and (
            f"train.allreduce=horovod: {problem}: build it with tools/build_horovod.sh "
            f"(`make install` does), or choose train.allreduce mpi"
            f"{', gloo or nccl' if cfg.backend == 'torch' else ''}"
        )
        if world is not None:
            world.agree(problem, error_type=ConfigError)
        elif problem:
            raise ConfigError(problem)
    if wanted != "auto":
        return wanted, "train.allreduce"
    if device == "cuda" and cfg["strategy"] == "pipeline":  # links on a process group
        if gpu_shared:
            return "gloo", "auto: ranks share a GPU, so Gloo stages the stages' messages"
        return "nccl", "auto: GPU stages exchange on the device with NCCL"
    if device == "cuda":
        if gpu_shared and mpi_only_features(cfg):  # these run on a process group's buffers
            return "gloo", "auto: ranks share a GPU, so Gloo stages its buffers through the host"
        if gpu_shared:
            return "mpi", "auto: ranks share a GPU, so gradients are staged through host memory"
        return "nccl", "auto: GPU ranks average on the device with NCCL"
    needs_mpi = mpi_features(cfg)
    if needs_mpi:
        verb = "runs" if len(needs_mpi) == 1 else "run"
        return "mpi", f"auto: {join_words(needs_mpi)} {verb} on the MPI engine"
    if compression not in ("none", "fp16"):  # fp16: Horovod's or the MPI engine's ring
        return "mpi", f"auto: train.compression={compression} runs on the MPI engine"
    if cfg.train["precision"] == "fp16":  # refused with horovod (composition.py)
        return "mpi", "auto: fp16 loss scaling runs on the MPI engine, not Horovod's"
    cores = cores or os.cpu_count() or 1
    busy = local_ranks * threads
    local_full = busy >= cores
    missing = None if local_full else horovod_problem(cfg.backend)  # asked only if wanted
    full = local_full or missing is not None
    if world is not None:
        full = world.any_flag(full, "agree on the gradient engine")
    if missing:
        return "mpi", f"auto: {missing}"
    if full and not local_full:
        return (
            "mpi",
            "auto: another node's ranks fill its cores or lack Horovod (agreed over all ranks)",
        )
    if full:
        return "mpi", f"auto: {local_ranks} rank(s) x {threads} thread(s), {cores} cores"
    return "horovod", f"auto: {cores - busy} spare core(s) for Horovod's engine"


def horovod_problem(framework: str) -> str | None:
    """Why Horovod's engine cannot run for `framework` here (not installed, or built
    without it), else None. Imports horovod.<framework>, as the engine would next."""
    try:
        importlib.import_module(f"horovod.{framework}")
    except ImportError as exc:
        return f"Horovod for {framework} is not installed here ({exc})"
    return None


def mpi_features(cfg) -> list[str]:
    """The features that are on in `cfg` and need the MPI engine on CPU ranks, as a user
    would name them (the reason `auto` gives for picking mpi names exactly these)."""
    return [f.words for f in exchange_features(cfg) if f.needs_mpi]


def join_words(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


# The dense MPI average moved to the framework-free exchange layer; the name stays.
FlatMean = DenseMean


def average_array(comm, arr: np.ndarray, what: str) -> np.ndarray:
    """Average `arr` over `comm` in place (integers as Horovod does: floor division)."""
    if comm is None or comm.size == 1:
        return arr
    comm.allreduce_inplace(arr, "sum", what)
    if np.issubdtype(arr.dtype, np.integer):
        arr //= comm.size
    else:
        arr /= comm.size
    return arr
