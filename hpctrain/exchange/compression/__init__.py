"""Gradient compression (`train.compression`, options in the `compression` section):
16-bit means (an own ring over MPI; the library's 16-bit allreduce over a process group)
and lossy compressors with error feedback (on either transport)."""

from __future__ import annotations

from .halfgroup import HalfMean
from .halfring import HalfRing
from .lossy import Int8, PowerSGD, RandomK, TopK

LOSSY = {"topk": TopK, "randomk": RandomK, "int8": Int8, "powersgd": PowerSGD}
HALF = ("fp16", "bf16")
# `train.compression`'s choices (config.py reads them here: one list of what exists)
METHODS = ("none", *HALF, *LOSSY)


def build(method: str, comm, shapes: list[tuple], opts: dict, what: str, ring: bool = True):
    """The reducer for `method` (not none) over `comm` for gradients of `shapes`;
    `ring`: 16-bit methods on the MPI ring (False: on a process group's own allreduce)."""
    if method in HALF:
        sizes = [int(_prod(s)) for s in shapes]
        return HalfRing(comm, sizes, method, what) if ring else HalfMean(comm, sizes, method, what)
    return LOSSY[method](comm, shapes, opts, what)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


__all__ = [
    "HALF",
    "HalfMean",
    "HalfRing",
    "Int8",
    "LOSSY",
    "METHODS",
    "PowerSGD",
    "RandomK",
    "TopK",
    "build",
]
