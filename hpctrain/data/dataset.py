"""Opening a user's HDF5 dataset: which datasets, which split, which dtypes and layout.

`open_dataset` reads metadata only and runs on every rank; `scan_dataset` reads every
label once (the only pass over data before training) and runs on one rank; together
they give a `DatasetInfo` that says exactly how batches reach the model, and
`describe()`/`summary()` put that into the run's config.yaml and first log lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import h5py
import numpy as np

from ..errors import DataError
from ..models.zoo import MODEL_TASK, InputSpec, is_zoo_model
from . import dtypes, layout
from .keys import DataKeys, resolve_keys

DEFAULT_VAL_FRACTION = 0.1  # held out when the file has no validation split


def model_kind(model_name: str) -> str:
    """'tokens' (language model), 'images' (convolutional zoo model), 'any' (flattens),
    or 'user' (the user's own model: what it takes is not known in advance)."""
    if not is_zoo_model(model_name):
        return "user"
    tasks = MODEL_TASK[model_name]
    if tasks == ("tokens",):
        return "tokens"
    return "images" if tasks == ("images",) else "any"


@dataclass(frozen=True)
class DataOptions:
    """The `data.*` keys that say how to read a user's file, plus the model it feeds."""

    keys: dict | None = None
    val_fraction: float | None = None
    layout: str = "auto"
    tokens: bool | None = None
    x_scale: float | None = None
    model: str = "mlp"
    seed: int = 1234

    @classmethod
    def from_config(cls, cfg) -> DataOptions:
        d = cfg.data
        return cls(
            keys=d.get("keys"),
            val_fraction=d.get("val_fraction"),
            layout=d.get("layout", "auto"),
            tokens=d.get("tokens"),
            x_scale=d.get("x_scale"),
            model=cfg.model["name"],
            seed=d["seed"],
        )


@dataclass(frozen=True, eq=False)
class DatasetInfo:
    """An opened dataset: where x/y are, split sizes, and how batches reach the model.

    input_spec is what the model sees (shape after the layout change, classes, tokens).
    train_rows/val_rows map split indices to file rows when validation is held out of
    a single split (None: the split is its own dataset).
    """

    path: str
    train_size: int
    val_size: int
    input_spec: InputSpec
    x_dtype: str
    attrs: dict
    keys: DataKeys = field(default_factory=DataKeys)
    casts: dtypes.Casts | None = None
    layout: str | None = None
    stored_shape: tuple[int, ...] | None = None
    train_rows: np.ndarray | None = None
    val_rows: np.ndarray | None = None
    val_source: str = "file"

    def convert(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A batch as read from the file -> what the model takes (dtype, layout)."""
        casts = self.casts or dtypes.Casts(self.x_dtype, self.input_spec.tokens)
        return layout.to_model_layout(dtypes.convert_x(x, casts), self.layout), dtypes.convert_y(
            y, casts
        )

    def describe(self) -> dict:
        """What hpctrain found in the file, for the run's config.yaml (`data.inferred`)."""
        inp, casts = self.input_spec, self.casts or dtypes.Casts(self.x_dtype, False)
        out = {
            "path": self.path,
            **self.keys.as_dict(),
            "train_samples": self.train_size,
            "val_samples": self.val_size,
            "validation": self.val_source,
            "sample_shape": list(inp.shape),
            "stored_shape": list(self.stored_shape or inp.shape),
            "layout": layout.describe(self.layout),
            "classes": inp.classes,
            "tokens": inp.tokens,
            "x": casts.describe_x(),
            "y": casts.describe_y(),
        }
        return {k: v for k, v in out.items() if v is not None}

    def summary(self) -> str:
        """One line for the run's first log lines."""
        d = self.describe()
        shape = tuple(d["sample_shape"])
        how = f" ({d['layout']})" if "layout" in d else ""
        what = "vocabulary" if self.input_spec.tokens else "classes"
        return (
            f"data {self.path}: {self.train_size} train + {self.val_size} val samples "
            f"({self.val_source}) of shape {shape}{how}, {self.input_spec.classes} {what}; "
            f"x {d['x']}, y {d['y']}"
        )


def _check_ranks(path, x_name: str, x, y_name: str, y) -> None:
    """Samples are arrays (a row of features, a sequence of tokens, an image) and labels
    one per sample at least: a scalar or a 1-D x passed every later check and failed in
    the first step, as a framework's shape error."""
    if y.ndim == 0:
        raise DataError(f"{path}: {y_name} is a single value, not one label per sample")
    if x.ndim < 2:
        what = "a single value" if x.ndim == 0 else f"one value per sample (shape {x.shape})"
        raise DataError(
            f"{path}: {x_name} holds {what}: samples must be arrays, shape (N, features) "
            "or more (one feature: reshape it to (N, 1))"
        )


def held_out_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, val rows), sorted: a random `fraction` of n rows, from `seed` only.

    Random rather than the last rows, because files are often sorted by class. Memory:
    about 4 bytes per row (int32 below 2**31 rows) on every rank, no communication.
    """
    k = int(round(n * fraction))
    if fraction > 0:
        k = min(max(k, 1), n - 1)
    rng = np.random.default_rng([seed, 0x76A1])
    dtype = np.int32 if n < 2**31 else np.int64
    val = np.sort(rng.choice(n, size=k, replace=False)).astype(dtype)
    keep = np.ones(n, dtype=bool)
    keep[val] = False
    return np.flatnonzero(keep).astype(dtype), val


def open_dataset(path: str | Path, options: DataOptions | None = None) -> DatasetInfo:
    """Open, find x/y, check shapes and dtypes, decide casts, layout and split.

    Reads metadata only (every rank does this). Classes are the attribute `classes`
    when the file has it, else 0 until `scan_dataset` has read the labels.
    """
    options = options or DataOptions()
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise DataError(f"dataset file not found: {path}")
    kind = model_kind(options.model)
    try:
        with h5py.File(path, "r") as f:
            keys = resolve_keys(f, path, options.keys)
            tx, ty = f[keys.train_x], f[keys.train_y]
            _check_ranks(path, keys.train_x, tx, keys.train_y, ty)
            if tx.shape[0] != ty.shape[0]:
                raise DataError(
                    f"{path}: {keys.train_x} has {tx.shape[0]} rows but {keys.train_y} "
                    f"has {ty.shape[0]}"
                )
            if tx.shape[0] == 0:
                raise DataError(f"{path}: the training split {keys.train_x} is empty")
            pair = (keys.train_x, keys.train_y)
            casts = dtypes.plan_casts(
                where, tx, ty, kind, options.model, options.tokens, options.x_scale, pair
            )
            train_size, val_size, val_source, train_rows, val_rows = _splits(
                path, f, keys, casts, kind, options
            )
            stored = tuple(tx.shape[1:])
            attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
            how = layout.decide_layout(
                where, stored, layout.declared(options.layout, attrs.get("layout")), kind
            )
            shape = layout.model_shape(stored, how)
            if kind == "images" and len(shape) != 3:
                raise DataError(
                    f"{path}: model {options.model} needs images (C, H, W), (H, W, C) or "
                    f"(H, W); samples of {keys.train_x} have shape {stored}"
                )
            classes = int(attrs["classes"]) if "classes" in attrs else 0
            return DatasetInfo(
                str(path),
                train_size,
                val_size,
                InputSpec(shape, classes, casts.tokens),
                str(tx.dtype),
                attrs,
                keys,
                casts,
                how,
                stored,
                train_rows,
                val_rows,
                val_source,
            )
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"cannot read dataset {path}: {exc}") from None


def _splits(path, f, keys, casts, kind, options):
    """(train size, validation size, where the validation comes from, the training rows
    and the held-out rows, or None for both where the file has a validation split)."""
    tx = f[keys.train_x]
    if keys.has_val:
        vx, vy = f[keys.val_x], f[keys.val_y]
        _check_val(path, keys, tx, vx, vy, casts, kind, options)
        if options.val_fraction is not None:
            raise DataError(
                f"{path}: data.val_fraction is set but the file has a validation "
                f"split ({keys.val_x}); remove one of the two"
            )
        return tx.shape[0], vx.shape[0], "file", None, None
    fraction = DEFAULT_VAL_FRACTION if options.val_fraction is None else options.val_fraction
    if fraction > 0 and tx.shape[0] < 2:
        raise DataError(f"{path}: {tx.shape[0]} sample(s): too few to hold out any")
    train_rows, val_rows = held_out_rows(tx.shape[0], fraction, options.seed)
    val_source = (
        f"{fraction:.0%} of {keys.train_x} held out, data.seed {options.seed}"
        if fraction > 0
        else "none (data.val_fraction 0)"
    )
    return len(train_rows), len(val_rows), val_source, train_rows, val_rows


def _check_val(path, keys, tx, vx, vy, casts, kind, options) -> None:
    if vx.shape[0] != vy.shape[0]:
        raise DataError(
            f"{path}: {keys.val_x} has {vx.shape[0]} rows but {keys.val_y} has {vy.shape[0]}"
        )
    if tx.shape[1:] != vx.shape[1:]:
        raise DataError(
            f"{path}: train samples {tuple(tx.shape[1:])} and val samples "
            f"{tuple(vx.shape[1:])} differ in shape"
        )
    val = dtypes.plan_casts(
        str(path),
        vx,
        vy,
        kind,
        options.model,
        options.tokens,
        options.x_scale,
        (keys.val_x, keys.val_y),
    )
    if (val.tokens, val.x_scale, val.squeeze_y) != (casts.tokens, casts.x_scale, casts.squeeze_y):
        raise DataError(
            f"{path}: {keys.train_x} ({casts.x_from}, labels {casts.y_from}) and {keys.val_x} "
            f"({val.x_from}, labels {val.y_from}) would be fed differently; store both "
            "splits with the same dtypes and shapes"
        )


# Classes (or a vocabulary) read off the labels beyond this are a damaged label, not a
# task: one label of 1e9 made a 1e9-wide output layer and a 474 GiB allocation. The
# largest vocabularies in use are ~256 K; a file's `classes` attribute is taken as given.
MAX_INFERRED_CLASSES = 1 << 24


def scan_dataset(info: DatasetInfo) -> int:
    """Check every label (and token id) against the classes; return the classes.

    One pass over the labels (token models: also over x), on one rank; a DataError
    names file, dataset, row and value. Classes: the file's attribute `classes`, else
    the largest label (or token) + 1.
    """
    casts = info.casts or dtypes.Casts(info.x_dtype, info.input_spec.tokens)
    known = int(info.attrs["classes"]) if "classes" in info.attrs else None
    source = ", the file's attribute classes" if known is not None else ""
    what = "vocabulary" if casts.tokens else "classes"
    where = info.path
    keys = info.keys
    top = -1
    try:
        with h5py.File(info.path, "r") as f:
            label_sets = [keys.train_y] + ([keys.val_y] if keys.has_val else [])
            for key in label_sets:
                top = max(
                    top,
                    dtypes.check_indices(where, key, f[key], known, what, casts.y_float, source),
                )
            if casts.tokens:
                for key in [keys.train_x] + ([keys.val_x] if keys.has_val else []):
                    top = max(
                        top, dtypes.check_indices(where, key, f[key], known, what, False, source)
                    )
    except OSError as exc:
        raise DataError(f"cannot read dataset {info.path}: {exc}") from None
    classes = known if known is not None else top + 1
    if known is None and classes > MAX_INFERRED_CLASSES:
        raise DataError(
            f"{where}: the largest {'token id' if casts.tokens else 'label'} is {top:,}, "
            f"which makes {classes:,} {what}: more than {MAX_INFERRED_CLASSES:,} is taken "
            f"for a damaged value (an output layer {classes:,} wide); if it is right, give "
            "the file the attribute `classes`"
        )
    if classes < 2 and not casts.tokens:
        raise DataError(
            f"{where}: every label in {keys.train_y} is {top}: training needs at least two "
            "classes (or the attribute `classes` on the file)"
        )
    return classes


def with_classes(info: DatasetInfo, classes: int) -> DatasetInfo:
    inp = info.input_spec
    return replace(info, input_spec=InputSpec(inp.shape, int(classes), inp.tokens))


def inspect_dataset(path: str | Path, options: DataOptions | None = None) -> DatasetInfo:
    """Open, check the layout, dtypes and every label, and describe the dataset.

    The single-process form of what `prepare_dataset` does across ranks.
    """
    info = open_dataset(path, options)
    return with_classes(info, scan_dataset(info))
