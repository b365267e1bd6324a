"""Ways of sharing the training work between ranks, chosen by the `strategy` config key.

Each strategy is a class taking `(cfg, run_dir=..., verbose=...)` with a `fit()` method
returning a summary dict, like `hpctrain.trainer.Trainer` (data parallel over Horovod).
Strategy modules may use MPI directly (through the World's communicators); everything
framework-specific stays in hpctrain/backends/.
"""

from __future__ import annotations

import importlib

# strategy name -> "module:Class"
RUNNERS: dict[str, str] = {
    "data_parallel": "hpctrain.trainer:Trainer",
    "pipeline": "hpctrain.strategies.pipeline:PipelineTrainer",
    "parameter_server": "hpctrain.strategies.ps.runner:ParameterServerRunner",
}


def runner_class(strategy: str):
    module_name, class_name = RUNNERS[strategy].split(":")
    return getattr(importlib.import_module(module_name), class_name)
