"""HDF5 checkpoints: atomic, fully checksummed, pickle-free (format: docs/checkpoint-format.md).

Rank 0 saves what every rank contributed; any process can verify and load:

    from hpctrain.checkpoint import Checkpointer, CheckpointPolicy, find_latest_valid
    ckpt = Checkpointer(CheckpointPolicy.from_config(cfg, run_dir), is_writer=rank == 0)
    ckpt.maybe_save(step, collect, epoch_end=True, agree=world.any_flag)
    latest = find_latest_valid(ckpt.policy.dir)   # None, or a verified Checkpoint
"""

from .format import FORMAT, checkpoint_name, step_of
from .manager import Checkpointer, resume_checkpoint
from .policy import DEFAULTS, CheckpointPolicy, Entry
from .reader import (
    Checkpoint,
    Mismatch,
    Summary,
    check_compatible,
    find_latest_valid,
    list_checkpoints,
    load,
    require_compatible,
    verify,
)
from .rng import capture_process_rng, restore_process_rng, rng_from_bytes, rng_to_bytes
from .sharded import split_replicated
from .writer import save, snapshot

__all__ = [
    "DEFAULTS",
    "FORMAT",
    "Checkpoint",
    "CheckpointPolicy",
    "Checkpointer",
    "Entry",
    "Mismatch",
    "Summary",
    "capture_process_rng",
    "check_compatible",
    "checkpoint_name",
    "find_latest_valid",
    "list_checkpoints",
    "load",
    "require_compatible",
    "restore_process_rng",
    "rng_from_bytes",
    "rng_to_bytes",
    "resume_checkpoint",
    "save",
    "snapshot",
    "split_replicated",
    "step_of",
    "verify",
]
