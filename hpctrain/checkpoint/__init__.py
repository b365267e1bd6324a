"""HDF5 checkpoints: atomic, fully checksummed, pickle-free (format: docs/checkpoint-format.md).

Rank 0 saves what every rank contributed; any process can verify and load:

    from hpctrain.checkpoint import Checkpointer, CheckpointPolicy, find_latest_valid
    ckpt = Checkpointer(CheckpointPolicy.from_config(cfg, run_dir), is_writer=rank == 0)
    ckpt.maybe_save(step, collect, epoch_end=True, agree=world.any_flag)
    latest = find_latest_valid(ckpt.policy.dir)   # None, or a verified Checkpoint
"""

import importlib

# name -> the module that defines it, imported on first use (PEP 562): the config schema
# reads policy.py's `checkpoint:` fields, and `hpctrain config` or `--help` should not
# pay for h5py (0.1 s) to import them
_EXPORTS = {
    "FORMAT": "format",
    "checkpoint_name": "format",
    "step_of": "format",
    "Checkpointer": "manager",
    "resume_checkpoint": "manager",
    "CheckpointPolicy": "policy",
    "Entry": "policy",
    "Checkpoint": "reader",
    "Mismatch": "reader",
    "Summary": "reader",
    "check_compatible": "reader",
    "find_latest_valid": "reader",
    "list_checkpoints": "reader",
    "load": "reader",
    "require_compatible": "reader",
    "verify": "reader",
    "capture_process_rng": "rng",
    "restore_process_rng": "rng",
    "rng_from_bytes": "rng",
    "rng_to_bytes": "rng",
    "split_replicated": "sharded",
    "save": "writer",
    "snapshot": "writer",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
