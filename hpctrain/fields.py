"""One configuration key's declaration, and its check: shared by the config schema
(config.py) and the sections that lower layers also read on their own (the checkpoint
policy's `checkpoint:`), so that a key is declared once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    """One configuration key: its default, accepted types and constraints."""

    default: Any
    types: tuple
    doc: str
    choices: tuple | None = None
    minimum: float | None = None
    exclusive_min: bool = False
    maximum: float | None = None
    exclusive_max: bool = False
    nullable: bool = False
    free_form: bool = False  # a mapping whose keys are checked elsewhere (model options)


def field(default, types, doc, **kw) -> Field:
    types = types if isinstance(types, tuple) else (types,)
    return Field(default, types, doc, **kw)


POS_INT = {"minimum": 1}
NONNEG = {"minimum": 0}
POSITIVE = {"minimum": 0, "exclusive_min": True}


def check_value(key: str, spec: Field, value: Any) -> str | None:
    """Why `value` does not fit `spec` (a message naming `key`), or None."""
    if value is None:
        return None if spec.nullable else f"{key}: must not be null"
    ok_type = isinstance(value, spec.types) and not (
        isinstance(value, bool) and bool not in spec.types
    )
    if not ok_type:
        names = "/".join(t.__name__ for t in spec.types)
        return f"{key}: expected {names}, got {type(value).__name__} {value!r}"
    if spec.choices is not None and value not in spec.choices:
        return f"{key}: {value!r} is not one of {', '.join(map(str, spec.choices))}"
    if spec.minimum is not None and isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}: must be finite, got {value!r}"
        if value < spec.minimum or (spec.exclusive_min and value == spec.minimum):
            op = ">" if spec.exclusive_min else ">="
            return f"{key}: must be {op} {spec.minimum:g}, got {value!r}"
    top = spec.maximum if isinstance(value, (int, float)) else None
    if top is not None and (value > top or (spec.exclusive_max and value == top)):
        op = "<" if spec.exclusive_max else "<="
        return f"{key}: must be {op} {top:g}, got {value!r}"
    return None
