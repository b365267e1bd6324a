"""Where x and y live in a user's HDF5 file: `data.keys`, or the names files commonly use.

Accepted without configuration, when exactly one of them is in the file:
- /train/x, /train/y (+ /val/x, /val/y): hpctrain's own layout;
- a flat pair: /x + /y, /images + /labels, /inputs + /targets, /features + /labels,
  /data + /labels (one split: validation is held out, see `data.val_fraction`).
Anything else needs `data.keys: {train_x: ..., train_y: ..., val_x: ..., val_y: ...}`
(val_x/val_y optional, together). A refusal lists the datasets the file does hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import h5py

from ..errors import DataError

KEY_NAMES = ("train_x", "train_y", "val_x", "val_y")
CANONICAL = ("/train/x", "/train/y", "/val/x", "/val/y")
FLAT_PAIRS = (
    ("/x", "/y"),
    ("/images", "/labels"),
    ("/inputs", "/targets"),
    ("/features", "/labels"),
    ("/data", "/labels"),
)
LISTED_AT_MOST = 12  # datasets named in a refusal; the rest are counted


@dataclass(frozen=True)
class DataKeys:
    """HDF5 paths of the splits; val_x/val_y None when the file has no validation split."""

    train_x: str = "/train/x"
    train_y: str = "/train/y"
    val_x: str | None = "/val/x"
    val_y: str | None = "/val/y"

    @property
    def has_val(self) -> bool:
        return self.val_x is not None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in KEY_NAMES if getattr(self, k) is not None}


def validate_keys_option(value) -> list[str]:
    """Problems with the `data.keys` config value (None is fine: detect)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [
            f"data.keys: expected a mapping like {{train_x: /images, train_y: /labels}}, got {value!r}"
        ]
    problems = []
    for key, path in value.items():
        if key not in KEY_NAMES:
            problems.append(f"data.keys.{key}: unknown key (known: {', '.join(KEY_NAMES)})")
        elif not isinstance(path, str) or not path.strip("/"):
            problems.append(f"data.keys.{key}: expected an HDF5 path like /images, got {path!r}")
    for needed in ("train_x", "train_y"):
        if needed not in value:
            problems.append(f"data.keys.{needed}: required when data.keys is set")
    if ("val_x" in value) != ("val_y" in value):
        problems.append("data.keys: give val_x and val_y together, or neither")
    return problems


def _norm(path: str) -> str:
    return "/" + path.strip("/")


def list_datasets(f: h5py.File) -> list[str]:
    """'/path shape dtype' of every dataset in the file, in file order."""
    found: list[str] = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            found.append(f"/{name} {tuple(obj.shape)} {obj.dtype}")

    f.visititems(visit)
    return found


def contents(f: h5py.File) -> str:
    """What the file holds, for a refusal message (at most LISTED_AT_MOST datasets)."""
    found = list_datasets(f)
    if not found:
        return "it holds no datasets"
    shown = ", ".join(found[:LISTED_AT_MOST])
    more = f" and {len(found) - LISTED_AT_MOST} more" if len(found) > LISTED_AT_MOST else ""
    return f"it holds {shown}{more}"


def _exists(f: h5py.File, path: str) -> bool:
    return isinstance(f.get(path.lstrip("/")), h5py.Dataset)


def resolve_keys(f: h5py.File, path, configured: dict | None) -> DataKeys:
    """The datasets to read, from `data.keys` or the known names; DataError otherwise."""
    if configured:
        keys = DataKeys(
            _norm(configured["train_x"]),
            _norm(configured["train_y"]),
            _norm(configured["val_x"]) if configured.get("val_x") else None,
            _norm(configured["val_y"]) if configured.get("val_y") else None,
        )
        for name in KEY_NAMES:
            where = getattr(keys, name)
            if where is not None and not _exists(f, where):
                raise DataError(
                    f"{path}: data.keys.{name} is {where}, which is not a dataset in the "
                    f"file; {contents(f)}"
                )
        return keys
    if _exists(f, CANONICAL[0]) and _exists(f, CANONICAL[1]):
        has_val = _exists(f, CANONICAL[2]) and _exists(f, CANONICAL[3])
        if not has_val and (_exists(f, CANONICAL[2]) or _exists(f, CANONICAL[3])):
            raise DataError(f"{path}: has only one of /val/x and /val/y; {contents(f)}")
        return DataKeys(*CANONICAL[:2], *(CANONICAL[2:] if has_val else (None, None)))
    pairs = [p for p in FLAT_PAIRS if _exists(f, p[0]) and _exists(f, p[1])]
    if len(pairs) == 1:
        return DataKeys(pairs[0][0], pairs[0][1], None, None)
    why = (
        f"several x/y pairs ({', '.join('+'.join(p) for p in pairs)})"
        if pairs
        else "no /train/x + /train/y and none of " + ", ".join("+".join(p) for p in FLAT_PAIRS)
    )
    raise DataError(
        f"{path}: cannot tell which datasets are x and y ({why}); {contents(f)}; set "
        "data.keys, e.g. --set 'data.keys={train_x: /images, train_y: /labels}'"
    )
