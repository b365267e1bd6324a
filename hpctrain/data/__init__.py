"""Training data: HDF5 datasets sharded across ranks, synthetic tasks, benchmark batches."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import DataError
from ..models.zoo import InputSpec
from ..runtime.diskspace import check_room
from .dataset import (
    DataOptions,
    DatasetInfo,
    inspect_dataset,
    open_dataset,
    scan_dataset,
    with_classes,
)
from .sharded import (
    BenchmarkData,
    ShardedTrainData,
    batch_problem,
    iterate_val,
    val_batch_count,
)
from .synthetic import (
    estimated_bytes,
    generate_from_config,
    memory_problem,
    synthetic_name,
    write_dataset,
)

__all__ = [
    "BenchmarkData",
    "DataOptions",
    "DatasetInfo",
    "ShardedTrainData",
    "batch_problem",
    "expand_path",
    "inspect_dataset",
    "iterate_val",
    "val_batch_count",
    "prepare_dataset",
    "benchmark_input_spec",
]


_VAR = re.compile(r"\$(?:(\w+)|\{([^}]*)\})", re.ASCII)  # as os.path.expandvars reads them


def expand_path(text: str, key: str, env=None) -> Path:
    """`text` with its $VARS / ${VARS} and a leading ~ expanded from this process's
    environment (per rank: node-local paths like $TMPDIR/train.h5 work on clusters).

    A variable that is not set stays as written (as os.path.expandvars leaves it), which
    would then be reported as a missing file; when the path does not exist, DataError
    names the unset variable instead.
    """
    env = os.environ if env is None else env
    unset: list[str] = []

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in env:
            return env[name]
        unset.append(name)
        return m.group(0)

    expanded = os.path.expanduser(_VAR.sub(value, text))  # ~/x.h5 as a shell reads it
    unset = list(dict.fromkeys(unset))
    if unset and not os.path.exists(expanded):
        names = ", ".join(f"${name}" for name in unset)
        verb = "is" if len(unset) == 1 else "are"
        raise DataError(
            f"{key}: {names} {verb} not set in this rank's environment ({key} is {text!r}): "
            "set it where the job starts (mpirun -x NAME passes it on) or write the path out"
        )
    return Path(expanded)


def benchmark_input_spec(dcfg: dict) -> InputSpec:
    """Sample shape of the benchmark mode's fixed random batch, from the data.* keys."""
    if dcfg["task"] == "vectors":
        return InputSpec((dcfg["features"],), dcfg["classes"])
    if dcfg["task"] == "images":
        return InputSpec(
            (dcfg["channels"], dcfg["image_size"], dcfg["image_size"]), dcfg["classes"]
        )
    return InputSpec((dcfg["seq_len"],), dcfg["vocab"], tokens=True)


def prepare_dataset(cfg, world, run_dir: Path) -> DatasetInfo:
    """The dataset this run trains on, checked on every rank.

    data.source=synthetic: rank 0 generates the task into <run-dir>/data/ (reused when
    already there); every rank then opens it, so a run directory that is not shared by
    all nodes is reported instead of training on different data.

    Every rank opens the file and checks its metadata (one open per rank); rank 0 alone
    reads every label to check it against the classes (one pass over the labels,
    whatever the number of ranks) and broadcasts the classes: at 1,024 or 4,096 ranks
    this costs one agreement (allreduce of a flag) and one small broadcast.
    """
    dcfg = cfg.data
    error = None
    if dcfg["source"] == "synthetic":
        path = Path(run_dir) / "data" / synthetic_name(dcfg)
        if world.rank == 0 and not path.exists():
            # too little memory or disk is refused before generating (the write checks
            # the disk again)
            asked = f"data.train_samples {dcfg['train_samples']} + data.val_samples "
            too_big = memory_problem(dcfg, asked + str(dcfg["val_samples"]))
            full = check_room(path.parent, estimated_bytes(dcfg))
            try:
                if too_big:
                    raise DataError(too_big)
                if full:
                    raise DataError(f"cannot write synthetic dataset {path}: {full}")
                splits, attrs = generate_from_config(dcfg)
                write_dataset(path, splits, attrs)
            except DataError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"could not write synthetic dataset {path}: {exc}"
        world.agree(error, error_type=DataError)
    else:
        # $VARS expand per rank: node-local paths like $TMPDIR/train.h5 work on clusters.
        try:
            path = expand_path(dcfg["path"], "data.path")
        except DataError as exc:
            error, path = str(exc), dcfg["path"]
    info = None
    if error is None:
        try:
            info = open_dataset(path, DataOptions.from_config(cfg))
        except DataError as exc:
            error = str(exc)
    world.agree(error, error_type=DataError)
    classes = None
    if world.rank == 0:
        try:
            classes = scan_dataset(info)
        except DataError as exc:
            error = str(exc)
    world.agree(error, error_type=DataError)
    info = with_classes(info, world.bcast_object(classes, what="broadcast the dataset's classes"))
    world.check_uniform(
        (info.train_size, info.val_size, *info.input_spec.shape, info.input_spec.classes),
        f"dataset {path} (train, val, sample shape, classes)",
    )
    return info
