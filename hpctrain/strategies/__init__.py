"""Ways of sharing the training work between ranks, chosen by the `strategy` config key.

Each strategy implements `base.Strategy` and runs under the one training loop
(hpctrain/loop.py). Strategy modules use MPI only through the runtime layer (the World
and the process grid); everything framework-specific stays in hpctrain/backends/.
This module stays import-light: the configuration schema reads `STRATEGIES`.
"""

from __future__ import annotations

import importlib

# strategy name -> "module:Class"
STRATEGIES: dict[str, str] = {
    "data_parallel": "hpctrain.strategies.data_parallel:DataParallel",
    "pipeline": "hpctrain.strategies.pipeline:Pipeline",
    "parameter_server": "hpctrain.strategies.ps.runner:ParameterServer",
}


def strategy_class(strategy: str):
    module_name, class_name = STRATEGIES[strategy].split(":")
    return getattr(importlib.import_module(module_name), class_name)
