"""What the model is fed, whatever dtypes the file holds: decided once, when it is opened.

- Features (x of every model but a language model) become float32, the models' float
  precision: float16/float64 are cast, integer arrays too; uint8 is taken as 8-bit
  pixels and scaled by 1/255 (as torchvision's ToTensor and Keras' Rescaling do) unless
  `data.x_scale` says otherwise.
- Token ids (x of a language model) become int64. Integer x is only taken as tokens
  when the model is a language model (zoo `transformer`) or `data.tokens: true`; a user
  model with integer x must say which it wants (`data.tokens: true|false`).
- Labels become int64: any integer or bool dtype; floats only when every value is a
  whole number; shape (n,) or (n, 1). Every label is checked against the classes
  (attribute `classes`, else the largest label + 1): a bad one is named with file,
  dataset, row and value.

The label scan reads each label once, in chunks of about 1M values (`scan_values`);
it runs on one rank only (prepare_dataset), so its cost does not grow with ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from ..errors import DataError

FEATURE_DTYPE = "float32"
TOKEN_DTYPE = "int64"
LABEL_DTYPE = "int64"
SCAN_CHUNK_VALUES = 1 << 20
_NUMERIC = ("f", "i", "u", "b")


@dataclass(frozen=True)
class Casts:
    """How x and y go from the file's dtypes to what the model takes."""

    x_from: str
    tokens: bool
    x_scale: float = 1.0
    y_from: str = "int64"
    y_float: bool = False  # labels stored as floats (whole numbers, checked by the scan)
    squeeze_y: bool = False  # labels stored (n, 1)

    @property
    def x_to(self) -> str:
        return TOKEN_DTYPE if self.tokens else FEATURE_DTYPE

    def describe_x(self) -> str:
        scale = f" x {_fmt_scale(self.x_scale)}" if self.x_scale != 1.0 else ""
        kind = "token ids" if self.tokens else "features"
        same = self.x_from == self.x_to and not scale
        return f"{self.x_from} {kind}" if same else f"{self.x_from} -> {self.x_to}{scale} {kind}"

    def describe_y(self) -> str:
        shape = " (n, 1) -> (n,)" if self.squeeze_y else ""
        same = self.y_from == LABEL_DTYPE
        return (
            f"{self.y_from} labels{shape}"
            if same
            else f"{self.y_from} -> {LABEL_DTYPE} labels{shape}"
        )


def _fmt_scale(scale: float) -> str:
    return "1/255" if abs(scale - 1 / 255) < 1e-12 else f"{scale:g}"


def plan_casts(
    where: str,
    x: h5py.Dataset,
    y: h5py.Dataset,
    model_kind: str,
    model_name: str,
    tokens_option: bool | None,
    x_scale_option: float | None,
    keys: tuple[str, str],
) -> Casts:
    """The casts for this file and model, or a one-line DataError saying what to change.

    model_kind: 'tokens' (a language model), 'images'/'any' (zoo models taking features)
    or 'user' (a user's model: integer x is ambiguous).
    """
    x_key, y_key = keys
    xk, yk = x.dtype.kind, y.dtype.kind
    if xk not in _NUMERIC:
        raise DataError(f"{where}: {x_key} holds {x.dtype}, not numbers hpctrain can feed a model")
    if yk not in _NUMERIC:
        raise DataError(f"{where}: {y_key} holds {y.dtype}; labels must be integer class indices")
    integer_x = xk in ("i", "u", "b")
    if tokens_option is True and not integer_x:
        raise DataError(f"{where}: data.tokens is true but {x_key} holds {x.dtype}, not token ids")
    if tokens_option is True and model_kind in ("images", "any"):
        raise DataError(
            f"{where}: data.tokens is true but model {model_name} takes features, not tokens"
        )
    if model_kind == "tokens":
        if not integer_x:
            raise DataError(
                f"{where}: model {model_name} needs integer token ids in {x_key}, "
                f"the file holds {x.dtype}"
            )
        if tokens_option is False:
            raise DataError(f"{where}: data.tokens is false but model {model_name} takes tokens")
        tokens = True
    elif tokens_option is not None:
        tokens = tokens_option
    elif integer_x and model_kind == "user":
        raise DataError(
            f"{where}: {x_key} holds {x.dtype} and {model_name} is your own model: set "
            "data.tokens true (token ids, fed as int64) or false (numbers, fed as float32)"
        )
    else:
        tokens = False
    if tokens:
        scale = 1.0
        if x_scale_option not in (None, 1, 1.0):
            raise DataError(f"{where}: data.x_scale applies to features, not token ids")
    elif x_scale_option is not None:
        scale = float(x_scale_option)
    else:
        scale = 1 / 255 if x.dtype == np.uint8 else 1.0
    squeeze = False
    if tokens:
        if y.shape[1:] != x.shape[1:]:
            raise DataError(
                f"{where}: token targets {y_key} {tuple(y.shape)} must have the shape of "
                f"the inputs {x_key} {tuple(x.shape)} (next token per position)"
            )
    elif y.shape[1:] == (1,):
        squeeze = True
    elif y.shape[1:] != ():
        hint = (
            ", which looks one-hot: store class indices (np.argmax(y, axis=1))"
            if len(y.shape) == 2
            else ""
        )
        raise DataError(
            f"{where}: {y_key} has shape {tuple(y.shape)}; expected one class index per "
            f"sample, shape ({y.shape[0]},){hint}"
        )
    return Casts(str(x.dtype), tokens, scale, str(y.dtype), yk == "f", squeeze)


def convert_x(x: np.ndarray, casts: Casts) -> np.ndarray:
    """A batch of x as the model takes it (freshly read, so scaled in place)."""
    if casts.tokens:
        return x.astype(np.int64, copy=False)
    out = x.astype(np.float32, copy=False)
    if casts.x_scale != 1.0:
        out = out if out is not x else out.copy()
        out *= np.float32(casts.x_scale)
    return out


def convert_y(y: np.ndarray, casts: Casts) -> np.ndarray:
    """A batch of labels as int64, (n,) for classification."""
    out = y.astype(np.int64, copy=False)
    return out.reshape(len(out)) if casts.squeeze_y else out


def scan_values(ds: h5py.Dataset, rows: np.ndarray | None = None):
    """Yield (first row, chunk) over the dataset, or over `rows` (sorted) of it."""
    per_row = int(np.prod(ds.shape[1:])) or 1
    step = max(1, SCAN_CHUNK_VALUES // per_row)
    if rows is None:
        for lo in range(0, ds.shape[0], step):
            yield lo, ds[lo : lo + step]
        return
    for lo in range(0, len(rows), step):
        part = rows[lo : lo + step]
        yield int(part[0]) if len(part) else 0, ds[part]


def check_indices(
    where: str,
    key: str,
    ds: h5py.Dataset,
    classes: int | None,
    what: str,
    integral: bool,
    classes_from: str = "",
) -> int:
    """The largest value of an index dataset (labels or token ids), after checking them.

    Every value must be a whole number in [0, classes) (classes None: >= 0 only). A
    DataError names file, dataset, row and value of the first bad one.
    """
    top = -1
    for lo, chunk in scan_values(ds):
        if chunk.size == 0:
            continue
        flat = chunk.reshape(len(chunk), -1)
        bad = np.zeros(len(chunk), dtype=bool)
        reason = ""
        if integral:
            whole = np.isfinite(flat) & (np.floor(flat) == flat)
            if not whole.all():
                bad = ~whole.all(axis=1)
                reason = "not a whole number"
        if not bad.any():
            low = (flat < 0).any(axis=1)
            high = (flat >= classes).any(axis=1) if classes is not None else low & False
            bad = low | high
            reason = (
                f"outside 0..{classes - 1} ({classes} {what}{classes_from})"
                if classes is not None
                else f"negative ({what} must be 0, 1, 2, ...)"
            )
        if bad.any():
            row = int(np.argmax(bad))
            values = flat[row]
            if integral and reason == "not a whole number":
                value = values[~(np.isfinite(values) & (np.floor(values) == values))][0]
            elif classes is not None:
                value = values[(values < 0) | (values >= classes)][0]
            else:
                value = values[values < 0][0]
            raise DataError(f"{where}: {key} row {lo + row} holds {value.item()!r}, {reason}")
        top = max(top, int(flat.max()))
    return top
