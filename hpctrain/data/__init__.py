"""Training data: HDF5 datasets sharded across ranks, synthetic tasks, benchmark batches."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataError
from ..models.zoo import InputSpec
from .sharded import BenchmarkData, DatasetInfo, ShardedTrainData, inspect_dataset, iterate_val
from .synthetic import generate_from_config, synthetic_name, write_dataset

__all__ = [
    "BenchmarkData",
    "DatasetInfo",
    "ShardedTrainData",
    "inspect_dataset",
    "iterate_val",
    "prepare_dataset",
    "benchmark_input_spec",
]


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
    """
    dcfg = cfg.data
    error = None
    if dcfg["source"] == "synthetic":
        path = Path(run_dir) / "data" / synthetic_name(dcfg)
        if world.rank == 0 and not path.exists():
            try:
                splits, attrs = generate_from_config(dcfg)
                write_dataset(path, splits, attrs)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"could not write synthetic dataset {path}: {exc}"
        world.agree(error)
    else:
        # $VARS expand per rank: node-local paths like $TMPDIR/train.h5 work on clusters.
        path = Path(os.path.expandvars(dcfg["path"]))
    info = None
    try:
        info = inspect_dataset(path)
    except DataError as exc:
        error = str(exc)
    world.agree(error)
    world.check_uniform(
        (info.train_size, info.val_size, *info.input_spec.shape, info.input_spec.classes),
        f"dataset {path} (train, val, sample shape, classes)",
    )
    return info
