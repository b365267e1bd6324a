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


# C++ notices TF prints at import even with TF_CPP_MIN_LOG_LEVEL set (absl logs before
# its InitializeLog ignore it, tensorflow issue 100442): the oneDNN notice on CPUs where
# oneDNN's custom ops are on by default, and absl's own banner.
IMPORT_NOISE = (
    "oneDNN custom operations are on",
    "All log messages before absl::InitializeLog()",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions",
)


def import_tensorflow():
    """`import tensorflow` with the C++ start-up notices above filtered out of stderr;
    every other line TF writes during the import (real errors) is passed on. The
    filter is only applied while quiet (TF_CPP_MIN_LOG_LEVEL 2 or 3)."""
    import sys

    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL") in ("0", "1"):
        import tensorflow

        return tensorflow
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not any(noise in line for noise in IMPORT_NOISE)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
    return tensorflow


quiet_tensorflow_startup()
