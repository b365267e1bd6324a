"""Python's and numpy's global random state as plain arrays (no pickle).

`random.getstate()` is (version, 625 words, gauss_next) and numpy's legacy
`np.random.get_state()` is ('MT19937', 624 words, pos, has_gauss, cached_gaussian);
both are stored as small numeric arrays so that a checkpoint holds numbers only.
Framework generators come from the backend (`backend.rng_state()`) and sit beside these
under their own keys ('torch', ...).
"""

from __future__ import annotations

import json
import random

import numpy as np

from ..errors import CheckpointError
from ..moe.parallel import jitter_rng_states, set_jitter_rng_states

PYTHON_KEYS = ("python.version", "python.state", "python.gauss")
NUMPY_KEYS = ("numpy.keys", "numpy.pos", "numpy.has_gauss", "numpy.cached_gaussian")


def capture_process_rng() -> dict[str, np.ndarray]:
    """This process's `random` and `np.random` global states as arrays, and its MoE
    layers' jitter generators (moe/parallel.py)."""
    version, words, gauss = random.getstate()
    algo, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if algo != "MT19937":  # pragma: no cover - numpy's legacy state is always MT19937
        raise CheckpointError(f"numpy global generator {algo} cannot be checkpointed")
    return {
        "python.version": np.array(version, dtype=np.int64),
        "python.state": np.array(words, dtype=np.uint32),
        # shape (0,) when no Gaussian is cached (gauss_next is None)
        "python.gauss": np.array([] if gauss is None else [gauss], dtype=np.float64),
        "numpy.keys": np.array(keys, dtype=np.uint32),
        "numpy.pos": np.array(pos, dtype=np.int64),
        "numpy.has_gauss": np.array(has_gauss, dtype=np.int64),
        "numpy.cached_gaussian": np.array(cached, dtype=np.float64),
        **jitter_rng_states(),
    }


def restore_process_rng(arrays: dict[str, np.ndarray]) -> None:
    """Put back what `capture_process_rng` took; other keys (e.g. 'torch') are ignored."""
    missing = [k for k in PYTHON_KEYS + NUMPY_KEYS if k not in arrays]
    if missing:
        raise CheckpointError(f"random state incomplete: missing {', '.join(missing)}")
    gauss = np.asarray(arrays["python.gauss"], dtype=np.float64).reshape(-1)
    random.setstate(
        (
            int(arrays["python.version"]),
            tuple(int(w) for w in np.asarray(arrays["python.state"]).reshape(-1)),
            float(gauss[0]) if gauss.size else None,
        )
    )
    np.random.set_state(
        (
            "MT19937",
            np.asarray(arrays["numpy.keys"], dtype=np.uint32),
            int(arrays["numpy.pos"]),
            int(arrays["numpy.has_gauss"]),
            float(arrays["numpy.cached_gaussian"]),
        )
    )
    set_jitter_rng_states(arrays)


def rng_to_bytes(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One rank's random state as a flat uint8 buffer, for a buffer-based MPI Gather.

    Layout: 4-byte little-endian length, a JSON list of [key, dtype, shape], then the
    arrays' bytes. Ranks of one job produce equal lengths (same backend, same keys),
    so `comm.Gather` works without pickle.
    """
    items = [(k, np.asarray(v, order="C")) for k, v in arrays.items()]
    header = json.dumps([[k, a.dtype.str, list(a.shape)] for k, a in items]).encode()
    parts = [np.frombuffer(len(header).to_bytes(4, "little") + header, np.uint8)]
    parts += [a.reshape(-1).view(np.uint8) for _, a in items]
    return np.concatenate(parts)


def rng_from_bytes(buf: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of `rng_to_bytes` (copies, so the buffer may be reused)."""
    raw = np.asarray(buf, dtype=np.uint8).tobytes()
    n = int.from_bytes(raw[:4], "little")
    pos, out = 4 + n, {}
    for key, dtype, shape in json.loads(raw[4 : 4 + n]):
        dt = np.dtype(dtype)
        if dt.kind not in "biufc":
            raise CheckpointError(f"random state {key!r}: unexpected dtype {dtype}")
        size = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        out[key] = np.frombuffer(raw[pos : pos + size], dtype=dt).reshape(tuple(shape)).copy()
        pos += size
    return out
