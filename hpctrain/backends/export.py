"""Framework-native weight files for users leaving hpctrain (`hpctrain ckpt export`).

- torch: `torch.save` of an OrderedDict {canonical name: tensor}, i.e. a state_dict in
  torch's layouts, loadable with `torch.load(path, weights_only=True)`.
- keras: an HDF5 file with one dataset per canonical weight converted to Keras layouts
  (dense kernel [in, out], conv kernel [kh, kw, in, out]) and a `keras_layers`
  attribute listing, per layer, the datasets in `layer.set_weights` order.

Only model weights are exported (no optimizer state, no trainer state). torch is
imported inside the function that needs it; the Keras file needs only h5py.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import yaml

KERAS_FORMAT = "hpctrain-keras-weights-1"
# set_weights order inside a Keras layer: kernel/gamma first, then bias/beta, then stats
_ROLE_ORDER = {"kernel": 0, "embeddings": 0, "gamma": 0, "bias": 1, "beta": 1}
_ROLE_ORDER.update({"moving_mean": 2, "moving_variance": 3})
SKIPPED = ("num_batches_tracked",)  # torch BatchNorm counter: no Keras weight


def _atomic_target(out: Path):
    """Write beside the target and rename, so OUT is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def write_torch(weights: dict[str, np.ndarray], out: str | Path) -> Path:
    """A torch state_dict file of `weights` (canonical names, torch layouts)."""
    import torch

    out = Path(out)
    tmp = _atomic_target(out)
    state = OrderedDict((k, torch.from_numpy(np.array(v, copy=True))) for k, v in weights.items())
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return out


def embedding_names(
    weights: dict[str, np.ndarray], config_yaml: str | None, patterns: list[str] = ()
) -> set[str]:
    """2-D weights that are lookup tables (kept [rows, dim]) rather than dense kernels.

    Zoo models: the layers of kind 'embed'. Other models: names with a component
    containing 'emb'. `patterns` (fnmatch) add names explicitly.
    """
    names = {k for k, v in weights.items() if np.ndim(v) == 2}
    found = {k for k in names if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    kinds = _zoo_layer_kinds(config_yaml)
    if kinds is not None:
        tables = [layer + "." for layer, kind in kinds.items() if kind == "embed"]
        return found | {k for k in names if k.startswith(tuple(tables))}
    return found | {k for k in names if any("emb" in part for part in k.split(".")[:-1])}


def _zoo_layer_kinds(config_yaml: str | None) -> dict[str, str] | None:
    """Layer name -> zoo kind, when the checkpoint's config names a zoo model."""
    from ..models import zoo

    try:
        model_cfg = (yaml.safe_load(config_yaml or "") or {}).get("model") or {}
    except yaml.YAMLError:
        return None
    name = model_cfg.get("name")
    if not isinstance(name, str) or not zoo.is_zoo_model(name):
        return None
    task = zoo.MODEL_TASK[name][0]
    shape = {"vectors": (8,), "images": (3, 8, 8), "tokens": (8,)}[task]
    inp = zoo.InputSpec(shape, 4, tokens=task == "tokens")  # kinds do not depend on sizes
    return {layer.name: layer.kind for layer in zoo.build_layers(model_cfg, inp)}


def keras_role(name: str, arr: np.ndarray, embeddings: set[str]) -> tuple[str, np.ndarray, str]:
    """(Keras weight role, array in Keras layout, description of the conversion)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "running_mean":
        return "moving_mean", arr, "unchanged"
    if leaf == "running_var":
        return "moving_variance", arr, "unchanged"
    if arr.ndim == 4:
        return (
            "kernel",
            np.ascontiguousarray(arr.transpose(2, 3, 1, 0)),
            "[out,in,kh,kw]->[kh,kw,in,out]",
        )
    if name in embeddings:
        return "embeddings", arr, "unchanged"
    if arr.ndim == 2:
        return "kernel", np.ascontiguousarray(arr.T), "[out,in]->[in,out]"
    if arr.ndim == 1 and leaf == "weight":
        return "gamma", arr, "unchanged"
    if arr.ndim == 1 and leaf == "bias":
        return "bias", arr, "unchanged"  # becomes 'beta' in a normalisation layer
    return leaf, arr, "unchanged"


def keras_weights(
    weights: dict[str, np.ndarray], embeddings: set[str]
) -> tuple[OrderedDict[str, tuple[str, np.ndarray, str]], dict[str, list[str]]]:
    """Converted weights plus, per layer (name minus the last component), set_weights order."""
    converted: OrderedDict[str, tuple[str, np.ndarray, str]] = OrderedDict()
    layers: dict[str, list[str]] = {}
    for name, arr in weights.items():
        if name.rsplit(".", 1)[-1] in SKIPPED:
            continue
        converted[name] = keras_role(name, np.asarray(arr), embeddings)
        layers.setdefault(name.rsplit(".", 1)[0] if "." in name else name, []).append(name)
    for names in layers.values():
        # in a normalisation layer (it has a scale or running statistics) bias is beta
        if any(converted[n][0] in ("gamma", "moving_mean") for n in names):
            for n in names:
                if converted[n][0] == "bias":
                    converted[n] = ("beta",) + converted[n][1:]
        names.sort(key=lambda n: _ROLE_ORDER.get(converted[n][0], 9))
    return converted, layers


def write_keras(
    weights: dict[str, np.ndarray],
    out: str | Path,
    config_yaml: str | None = None,
    keep_layout: list[str] = (),
    source: str = "",
) -> Path:
    """One HDF5 dataset per weight in Keras layout, plus the per-layer set_weights lists."""
    out = Path(out)
    embeddings = embedding_names(weights, config_yaml, list(keep_layout))
    converted, layers = keras_weights(weights, embeddings)
    tmp = _atomic_target(out)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = KERAS_FORMAT
            f.attrs["source"] = source
            f.attrs["keras_layers"] = json.dumps(layers)
            for name, (role, value, how) in converted.items():
                ds = f.create_dataset(name, data=value)
                ds.attrs["keras_role"] = role
                ds.attrs["conversion"] = how
                ds.attrs["torch_shape"] = np.array(np.shape(weights[name]), dtype=np.int64)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return out
