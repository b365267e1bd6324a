"""Framework-native files for users leaving hpctrain (`hpctrain ckpt export`).

Whole models (zoo models only; `zoo_export` says which model, inputs and layers):
- torchscript: the zoo model of torch's standard modules with the checkpoint's weights,
  scripted and saved; `torch.jit.load` needs no hpctrain (export_torchscript.py).
- keras-model: the zoo model as a functional Keras model of Keras's own layers, saved
  as `.keras`; `keras.models.load_model` needs no hpctrain (export_keras_model.py).

Weights only (torch, keras), for any model. A checkpoint's weights come in one of two
layouts, told apart by the run's config:
- torch layout, names `<layer>.<param>`: every zoo model (both backends keep the
  canonical torch layout) and a user's torch nn.Module;
- Keras layout, names `<layer>/<weight>` (Keras variable paths): a user's Keras model.

Weight exports:
- torch: `torch.save` of an OrderedDict {name: tensor} in torch layouts, loadable with
  `torch.load(path, weights_only=True)` into the model's state_dict. Keras-layout
  weights are converted (kernel [in, out] -> weight [out, in], conv kernel
  [kh, kw, in, out] -> [out, in, kh, kw], gamma/beta/moving_* -> weight/bias/running_*,
  `a/b/kernel` -> `a.b.weight`), so a torch module with the same layer names loads them.
- keras: an HDF5 file with one dataset per weight in Keras layouts and a `keras_layers`
  attribute mapping each layer (its path; nested layers joined by '/') to its
  datasets in `layer.set_weights` order. Torch-layout weights are converted
  (dense [out, in] -> kernel [in, out], conv [out, in, kh, kw] -> [kh, kw, in, out]);
  Keras-layout weights are written as they are.

No optimizer or trainer state is exported. torch and Keras are imported inside the
functions that need them; the Keras weights file needs only h5py.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import h5py
import numpy as np
import yaml

from ..models import zoo
from . import require_framework

KERAS_FORMAT = "hpctrain-keras-weights-1"
# set_weights order inside a Keras layer: kernel/gamma first, then bias/beta, then stats
_ROLE_ORDER = {"kernel": 0, "embeddings": 0, "gamma": 0, "bias": 1, "beta": 1}
_ROLE_ORDER.update({"moving_mean": 2, "moving_variance": 3})
SKIPPED = ("num_batches_tracked",)  # torch BatchNorm counter: no Keras weight


def _write_atomically(out: Path, save, suffix: str = "") -> None:
    """`save(tmp)` into a file beside `out` (name + `suffix`), then renamed over it, so
    OUT is never half-written; the temporary is removed whatever happens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{suffix}")
    try:
        save(tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def source_layout(weights: dict[str, np.ndarray], config_yaml: str | None) -> str:
    """'keras' for a user's Keras model (TF backend, not a zoo model), else 'torch'."""
    try:
        cfg = yaml.safe_load(config_yaml or "") or {}
    except yaml.YAMLError:
        cfg = {}
    name = (cfg.get("model") or {}).get("name") if isinstance(cfg, dict) else None
    if isinstance(name, str) and cfg.get("backend"):
        user_keras = cfg["backend"] == "tensorflow" and not zoo.is_zoo_model(name)
        return "keras" if user_keras else "torch"
    return "keras" if any("/" in k for k in weights) else "torch"


# Keras weight name -> torch parameter name, for Keras-layout weights exported to torch
_TORCH_LEAF = {
    "kernel": "weight",
    "embeddings": "weight",
    "gamma": "weight",
    "beta": "bias",
    "bias": "bias",
    "moving_mean": "running_mean",
    "moving_variance": "running_var",
}


def torch_from_keras(weights: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """Keras-layout weights as a torch state_dict: `dense1/kernel` [in, out] ->
    `dense1.weight` [out, in], conv kernels [kh, kw, in, out] -> [out, in, kh, kw]."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, arr in weights.items():
        layer, _, leaf = name.rpartition("/")
        arr = np.asarray(arr)
        if leaf == "kernel" and arr.ndim == 2:
            arr = arr.T
        elif leaf == "kernel" and arr.ndim == 4:
            arr = arr.transpose(3, 2, 0, 1)
        torch_name = f"{layer.replace('/', '.')}.{_TORCH_LEAF.get(leaf, leaf)}" if layer else leaf
        if torch_name in out:
            raise ValueError(f"two Keras weights map to torch name {torch_name!r}")
        out[torch_name] = np.ascontiguousarray(arr)
    return out


def write_torch(
    weights: dict[str, np.ndarray], out: str | Path, config_yaml: str | None = None
) -> Path:
    """A torch state_dict file of `weights` (torch names and layouts)."""
    import torch

    if source_layout(weights, config_yaml) == "keras":
        weights = torch_from_keras(weights)
    out = Path(out)
    state = OrderedDict((k, torch.from_numpy(np.array(v, copy=True))) for k, v in weights.items())
    _write_atomically(out, lambda tmp: torch.save(state, tmp))
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


def keras_native_weights(
    weights: dict[str, np.ndarray],
) -> tuple[OrderedDict[str, tuple[str, np.ndarray, str]], dict[str, list[str]]]:
    """Weights already in Keras layout (a user's Keras model): kept as they are, grouped
    by layer path (`block/dense1/kernel` -> layer `block/dense1`), set_weights order."""
    converted: OrderedDict[str, tuple[str, np.ndarray, str]] = OrderedDict()
    layers: dict[str, list[str]] = {}
    for name, arr in weights.items():
        layer, _, leaf = name.rpartition("/")
        converted[name] = (leaf, np.asarray(arr), "unchanged (Keras layout)")
        layers.setdefault(layer or name, []).append(name)
    for names in layers.values():
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
    layout = source_layout(weights, config_yaml)
    if layout == "keras":
        converted, layers = keras_native_weights(weights)
    else:
        embeddings = embedding_names(weights, config_yaml, list(keep_layout))
        converted, layers = keras_weights(weights, embeddings)

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = KERAS_FORMAT
            f.attrs["source"] = source
            f.attrs["keras_layers"] = json.dumps(layers)
            f.attrs["source_layout"] = layout
            for name, (role, value, how) in converted.items():
                ds = f.create_dataset(name, data=value)
                ds.attrs["keras_role"] = role
                ds.attrs["conversion"] = how
                if layout == "torch":
                    ds.attrs["torch_shape"] = np.array(np.shape(weights[name]), dtype=np.int64)

    _write_atomically(out, write)
    return out


# --- whole models: the zoo model rebuilt from standard layers, weights included -------------
@dataclass
class ZooExport:
    """What a whole-model export needs: the zoo model, its inputs and layers."""

    name: str
    inp: zoo.InputSpec
    layers: list[zoo.LayerSpec]
    x: str  # how the run's data reached the model (`data.inferred.x`), or ""
    layout: str  # the run's image layout change (`data.inferred.layout`), or ""

    def input_line(self) -> str:
        """One line: what the exported model takes and returns."""
        if self.inp.tokens:
            x = f"int64 token ids [N, T], T <= {self.inp.shape[0]}"
            y = f"logits [N, T, {self.inp.classes}]"
        else:
            dims = ", ".join(
                "HW"[i - 1] if d is None else str(d) for i, d in enumerate(self.inp.shape)
            )
            x = f"float32 [N, {dims}]" + (" (NCHW)" if len(self.inp.shape) == 3 else "")
            y = f"logits [N, {self.inp.classes}]"
        how = "; ".join(s for s in (self.x, self.layout) if s)
        fed = f" as hpctrain fed the model (data: {how})" if how else " as hpctrain fed the model"
        return f"input {x}{fed}; output {y}"

    def info(self) -> dict:
        return {
            "format": WHOLE_MODEL_FORMAT,
            "model": self.name,
            "sample_shape": list(self.inp.shape),
            "classes": self.inp.classes,
            "tokens": self.inp.tokens,
            "data_x": self.x,
            "data_layout": self.layout,
            "input": self.input_line(),
        }


WHOLE_MODEL_FORMAT = "hpctrain-export-1"


def _run_inferred(model_cfg: dict, data: dict, source: Path | None) -> dict:
    """`data.inferred` (what the data loader fed the model) of the run's config.yaml,
    which sits beside the checkpoint directory, when that run trained this model on this
    data; checkpoints keep the configuration without it."""
    if source is None:
        return {}
    for run_config in (source.parent.parent / "config.yaml", source.parent / "config.yaml"):
        try:
            run = yaml.safe_load(run_config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(run, dict) or run.get("model") != model_cfg:
            continue
        rdata = run.get("data") or {}
        same = all(rdata.get(k) == data.get(k) for k in ("source", "path", "task", "keys"))
        if same and isinstance(rdata.get("inferred"), dict):
            return rdata["inferred"]
    return {}


def _input_spec(
    model_cfg: dict, data: dict, weights: dict[str, np.ndarray], inferred: dict
) -> tuple[zoo.InputSpec, str, str]:
    """(the model's input, how the data reached it, its layout change): from the run's
    `data.inferred`, else the synthetic task's settings, else the weights' shapes (then
    images are [C, H, W] of any size and an mlp takes flat vectors)."""
    if inferred.get("sample_shape") and inferred.get("classes"):
        shape = tuple(int(d) for d in inferred["sample_shape"])
        inp = zoo.InputSpec(shape, int(inferred["classes"]), bool(inferred.get("tokens")))
        return inp, str(inferred.get("x") or ""), str(inferred.get("layout") or "")
    name, classes = model_cfg["name"], int(weights["head.weight"].shape[0])
    task = data.get("task")
    if data.get("source") == "synthetic" and task in zoo.MODEL_TASK[name]:
        if task == "vectors":
            return zoo.InputSpec((int(data["features"]),), classes), "float32 features", ""
        if task == "images":
            side = int(data["image_size"])
            shape = (int(data["channels"]), side, side)
            return zoo.InputSpec(shape, classes), "float32 images", ""
        return zoo.InputSpec((int(data["seq_len"]),), classes, tokens=True), "int64 tokens", ""
    if name == "transformer":
        seq = int(weights["embed.pos.weight"].shape[0])
        return zoo.InputSpec((seq,), classes, tokens=True), "", ""
    if name == "mlp":
        return zoo.InputSpec((int(weights["fc1.weight"].shape[1]),), classes), "", ""
    first = "stem.conv.weight" if name == "resnet" else "conv1.weight"
    return zoo.InputSpec((int(weights[first].shape[1]), None, None), classes), "", ""


def zoo_export(
    weights: dict[str, np.ndarray],
    config_yaml: str | None,
    to: str,
    source: str | Path | None = None,
) -> ZooExport:
    """The zoo model of a checkpoint, for `--to torchscript|keras-model`; refuses, with
    one line naming what works instead, what has no standalone form."""
    from ..errors import CheckpointError

    try:
        cfg = yaml.safe_load(config_yaml or "") or {}
    except yaml.YAMLError:
        cfg = {}
    model_cfg = (cfg.get("model") if isinstance(cfg, dict) else None) or {}
    name = model_cfg.get("name")
    if not isinstance(name, str):
        raise CheckpointError(
            f"--to {to}: the checkpoint holds no run configuration naming its model; "
            "use --to torch or --to keras and load the weights into your model"
        )
    if not zoo.is_zoo_model(name):
        raise CheckpointError(
            f"--to {to}: exports hpctrain's zoo models (mlp, cnn, resnet, transformer), and "
            f"this checkpoint's model is your own ({name}); use --to torch or --to keras "
            "and load the weights into your model (docs/bring-your-own.md)"
        )
    if zoo.has_moe(model_cfg):
        raise CheckpointError(
            f"--to {to}: a transformer with mixture-of-experts blocks (model.moe) has no "
            "standalone form (its routing drops tokens by a capacity that depends on the "
            "batch); use --to torch for its weights"
        )
    data = cfg.get("data") or {}
    inferred = data.get("inferred") or _run_inferred(
        model_cfg, data, Path(source) if source else None
    )
    try:
        inp, x, layout = _input_spec(model_cfg, data, weights, inferred)
        layers = zoo.build_layers(model_cfg, inp)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"--to {to}: the weights do not match the {name} of the checkpoint's config "
            f"({type(exc).__name__}: {exc})"
        ) from None
    names = set(zoo.param_names(layers)) | set(zoo.buffer_names(layers))
    have = {k for k in weights if k.rsplit(".", 1)[-1] not in SKIPPED}
    if names != have:
        missing, extra = sorted(names - have), sorted(have - names)
        raise CheckpointError(
            f"--to {to}: the weights do not match the {name} of the checkpoint's config "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for layer in layers:
        for group in (layer.params, layer.buffers):
            for p, shape in group.items():
                key = f"{layer.name}.{p}"
                if tuple(np.shape(weights[key])) != tuple(shape):
                    raise CheckpointError(
                        f"--to {to}: {key} has shape {tuple(np.shape(weights[key]))}, the "
                        f"{name} of the checkpoint's config needs {tuple(shape)}"
                    )
    return ZooExport(name, inp, layers, x, layout)


def write_torchscript(
    weights: dict[str, np.ndarray],
    out: str | Path,
    config_yaml: str | None,
    source: str | Path | None = None,
) -> tuple[Path, ZooExport]:
    """A TorchScript file of the zoo model with these weights (torch.jit.load, no
    hpctrain). `source`: the checkpoint's path, to find its run's config.yaml."""
    from . import export_torchscript

    spec = zoo_export(weights, config_yaml, "torchscript", source)
    out = Path(out)
    mlp = spec.name == "mlp"
    _write_atomically(
        out, lambda tmp: export_torchscript.save(spec.layers, weights, tmp, spec.info(), mlp)
    )
    return out, spec


def write_keras_model(
    weights: dict[str, np.ndarray],
    out: str | Path,
    config_yaml: str | None,
    source: str | Path | None = None,
) -> tuple[Path, ZooExport]:
    """A .keras file of the zoo model with these weights (keras.models.load_model, no
    hpctrain, no custom objects)."""
    from ..errors import CheckpointError

    out = Path(out)
    if out.suffix != ".keras":
        raise CheckpointError(
            f"--to keras-model: {out}: the file name must end in .keras "
            "(Keras 3 saves and loads whole models only under that extension)"
        )
    require_framework("tensorflow", "--to keras-model needs")
    spec = zoo_export(weights, config_yaml, "keras-model", source)
    from . import export_keras_model

    save = partial(export_keras_model.save, spec.layers, weights, spec.inp, spec.name)
    _write_atomically(out, save, ".keras")  # Keras 3 saves whole models only as .keras
    return out, spec
