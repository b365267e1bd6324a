"""Gradient compression on the MPI engine (`train.compression`, options in the
`compression` section): 16-bit rings and lossy compressors with error feedback."""

from __future__ import annotations

from .halfring import HalfRing
from .lossy import Int8, PowerSGD, RandomK, TopK

LOSSY = {"topk": TopK, "randomk": RandomK, "int8": Int8, "powersgd": PowerSGD}
HALF = ("fp16", "bf16")
# `train.compression`'s choices (config.py reads them here: one list of what exists)
METHODS = ("none", *HALF, *LOSSY)


def build(method: str, comm, shapes: list[tuple], opts: dict, what: str):
    """The reducer for `method` (not none) over `comm` for gradients of `shapes`."""
    if method in HALF:
        return HalfRing(comm, [int(_prod(s)) for s in shapes], method, what)
    return LOSSY[method](comm, shapes, opts, what)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


__all__ = ["HALF", "HalfRing", "Int8", "LOSSY", "METHODS", "PowerSGD", "RandomK", "TopK", "build"]
