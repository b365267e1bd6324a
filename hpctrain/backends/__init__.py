"""Framework backends. Only modules in this package import torch, TensorFlow or Horovod.

`load_backend(name)` imports one lazily, so a torch run never pays for TensorFlow.
"""

from __future__ import annotations

import importlib

BACKENDS = ("torch", "tensorflow")


def load_backend(name: str):
    """The backend module for `name` ('torch' or 'tensorflow')."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    return importlib.import_module(f"hpctrain.backends.{name}")
