"""TensorFlow's start-up noise, silenced before TensorFlow is imported.

TF's C++ runtime prints its CPU-feature guard, oneDNN notice and absl lines on every rank
at import unless TF_CPP_MIN_LOG_LEVEL is set first; settings made after `import
tensorflow` come too late. Importing this module (it imports nothing heavy) sets them,
keeping any value the user exported (TF_CPP_MIN_LOG_LEVEL=0 brings everything back).
Errors (level 2) still print. Call `quiet_python_loggers()` after TF is imported to
lower TF's and absl's Python loggers too.
"""

from __future__ import annotations

import logging
import os

ENV_DEFAULTS = {
    "TF_CPP_MIN_LOG_LEVEL": "2",  # C++ INFO and WARNING: feature guard, oneDNN notice
    "GRPC_VERBOSITY": "ERROR",  # gRPC's fork/poll warnings
}


def quiet_tensorflow_startup(env=None) -> None:
    """Set the environment TF reads at import (user-set values win)."""
    env = os.environ if env is None else env
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)


def quiet_python_loggers() -> None:
    """TF's and absl's Python loggers at ERROR (retracing and deprecation warnings)."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2") in ("0", "1"):
        return  # the user asked for TF's messages
    for name in ("tensorflow", "absl", "h5py._conv"):
        logging.getLogger(name).setLevel(logging.ERROR)


quiet_tensorflow_startup()
