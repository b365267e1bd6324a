"""The exchange layer's array seam (`exchange.transport.Arrays`) for host numpy buffers.

Why: ZeRO's partition and the gradient compressors are written once, over a transport
that allocates and computes locally on its own arrays; the MPI transport's arrays are
numpy, in the arithmetic they always had (the torch transport's twin:
backends/torch_arrays.py). Every method is local: no communication, no synchronisation.
"""

from __future__ import annotations

import numpy as np


class HostArrays:
    @staticmethod
    def zeros(n: int, dtype: str = "float32") -> np.ndarray:
        return np.zeros(int(n), dtype=dtype)

    @staticmethod
    def square_sum(buf: np.ndarray):
        g = buf.astype(np.float64)
        return np.dot(g, g)

    @classmethod
    def square_sum_where(cls, buf: np.ndarray, mask: np.ndarray):
        return cls.square_sum(buf[mask])

    @staticmethod
    def scale_(buf: np.ndarray, factor: float) -> None:
        buf *= np.float32(factor)

    @staticmethod
    def clip_coefficient(square_sum, max_norm: float) -> np.ndarray:
        coef = np.float64(max_norm) / (np.sqrt(np.float64(square_sum)) + 1e-6)
        return np.minimum(coef, np.float64(1.0))

    @staticmethod
    def copy(buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    @staticmethod
    def concat(bufs: list) -> np.ndarray:
        return np.concatenate([np.reshape(b, -1) for b in bufs])

    @staticmethod
    def astype(buf, dtype: str) -> np.ndarray:
        return np.asarray(buf).astype(dtype)

    @staticmethod
    def bitcast(buf: np.ndarray, dtype: str) -> np.ndarray:
        return buf.view(dtype)

    @staticmethod
    def top_k_indices(buf: np.ndarray, k: int) -> np.ndarray:
        """The int32 positions of the k largest magnitudes (any order)."""
        return np.argpartition(np.abs(buf), buf.size - k)[buf.size - k :].astype(np.int32)

    @staticmethod
    def take(buf: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(buf[idx])

    @staticmethod
    def put_(buf: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
        buf[idx] = values

    @staticmethod
    def index_add_(buf: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
        np.add.at(buf, idx, values)

    @staticmethod
    def round_clip(buf: np.ndarray, lo: float, hi: float) -> np.ndarray:
        """Rounded half to even, then clipped to [lo, hi]."""
        return np.clip(np.rint(buf), lo, hi)

    @staticmethod
    def qr(mat: np.ndarray) -> np.ndarray:
        """The orthonormal factor Q of `mat` (reduced), float32."""
        return np.linalg.qr(mat)[0].astype(np.float32)

    @staticmethod
    def from_host(values: np.ndarray) -> np.ndarray:
        return np.asarray(values)

    @staticmethod
    def to_host(buf: np.ndarray) -> np.ndarray:
        return np.array(buf, copy=True)
