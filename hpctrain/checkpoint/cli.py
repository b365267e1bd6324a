"""`hpctrain ckpt inspect | verify | export`: look into, check and leave checkpoints.

None of these start MPI; they run on a login node as well as inside a job.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from ..errors import CheckpointError, rank_ranges, require_path
from . import reader, sharded
from .format import MAGIC

EXPORT_HELP = """\
torchscript: the zoo model (mlp, cnn, resnet, transformer) with these weights as a
       TorchScript module built from torch's standard layers, in eval mode; needs only
       torch, not hpctrain:
         model = torch.jit.load(OUT); logits = model(x)
keras-model: the zoo model as a functional Keras model of Keras's own layers (OUT must
       end in .keras); needs only Keras 3, no custom objects:
         model = keras.models.load_model(OUT); logits = model.predict(x)
       Both take the input as hpctrain fed its model (float32 features; float32 NCHW
       images, uint8 pixels already times 1/255 or data.x_scale; token ids [N, T]) and
       return logits; the export prints the shapes. Not for your own models nor
       mixture-of-experts blocks: export their weights (torch, keras) instead.
torch: a torch.save() file of an OrderedDict {name: tensor} (the model's state_dict in
       torch layouts); load with torch.load(OUT, weights_only=True). A user's Keras
       model is converted (dense1/kernel [in, out] -> dense1.weight [out, in]).
keras: an HDF5 file, one dataset per weight in Keras layouts (dense kernel [in, out],
       conv kernel [kh, kw, in, out]); its attribute keras_layers lists, per layer,
       the datasets in layer.set_weights() order. A user's Keras model is written as
       it is, keyed by its layers' names:
         for layer, names in json.loads(f.attrs["keras_layers"]).items():
             model.get_layer(layer).set_weights([f[n][()] for n in names])
No optimizer, trainer or random state is exported.
Details: docs/checkpoints.md#leaving-hpctrain; recipes for your own models:
docs/bring-your-own.md."""


def register(subparsers) -> dict:
    p = subparsers.add_parser(
        "ckpt",
        help="inspect, verify and export checkpoints",
        description="Tools for hpctrain's HDF5 checkpoints (ckpt-<step>.h5).",
    )
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    s = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Verify a checkpoint, then show its step, run facts, trainer and "
        "random state, every dataset (dtype, shape, size) and the run's config.",
    )
    s.add_argument("file", metavar="FILE", help="a checkpoint (ckpt-<step>.h5)")
    s.add_argument("--no-config", action="store_true", help="leave the config out")
    s = sub.add_parser(
        "verify",
        help="check checksums of one or more checkpoints",
        description="One line per file; exit status 0 only when every file verifies.",
    )
    s.add_argument("files", nargs="+", metavar="FILE")
    s = sub.add_parser(
        "export",
        help="write the model as TorchScript or .keras, or its weights for torch or Keras",
        description="Export a verified checkpoint's model: a whole zoo model that loads "
        "without hpctrain (torchscript, keras-model), or the weights (torch, keras).",
        epilog=EXPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("file", metavar="FILE", help="a checkpoint (ckpt-<step>.h5)")
    s.add_argument(
        "--to",
        required=True,
        choices=("torchscript", "keras-model", "torch", "keras"),
        help="output kind (below)",
    )
    s.add_argument(
        "out", metavar="OUT", help="file to write (atomically; an existing one needs --force)"
    )
    s.add_argument(
        "--force", action="store_true", help="replace OUT if it exists (never a checkpoint)"
    )
    s.add_argument(
        "--keep-layout",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keras: 2-D weights matching this glob are lookup tables, not kernels "
        "(kept [rows, dim]); zoo models need none",
    )
    return {"ckpt": run}


def run(args) -> int:
    return {"inspect": _inspect, "verify": _verify, "export": _export}[args.ckpt_command](args)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _verify(args) -> int:
    bad = 0
    for name in args.files:
        try:
            s = reader.verify(name)
            print(f"OK    {name}: step {s.step}, {s.datasets} datasets, {_mb(s.nbytes)}")
        except CheckpointError as exc:
            bad += 1
            print(f"FAIL  {exc}")
    return 1 if bad else 0


def _configured_strategy(config: str | None) -> str:
    """The strategy a checkpoint's run had: data-parallel ones record it only in their
    config (the pipeline and the parameter server also as an attribute)."""
    import yaml

    try:
        values = yaml.safe_load(config or "")
    except yaml.YAMLError:
        values = None
    if isinstance(values, dict):
        return str(values.get("strategy", "data_parallel"))
    return "not recorded"


def _inspect(args) -> int:
    try:
        ck = reader.load(args.file)
    except CheckpointError as exc:
        print(f"verified    NO: {exc}")
        return 1
    a = dict(ck.attrs)
    rows = [
        ("file", f"{ck.path} ({_mb(ck.path.stat().st_size)} on disk)"),
        ("verified", "yes (file digest, manifest and every dataset's digest)"),
        (
            "format",
            f"{a.pop('format')} (hpctrain {a.pop('hpctrain_version')}, "
            f"h5py {a.pop('h5py_version')}, HDF5 {a.pop('hdf5_version')})",
        ),
        ("created", a.pop("created_utc")),
        ("step", a.pop("step")),
    ]
    shards = a.pop("shards", None)
    if shards:
        rows.append(("shards", f"{shards} files in {sharded.shards_dir(ck.path)}, verified"))
    config = a.pop("config_yaml", None)
    rows.append(("strategy", a.pop("strategy", None) or _configured_strategy(config)))
    for key in ("backend", "framework", "horovod", "world_size"):
        if key in a:
            rows.append((key.replace("_", " "), a.pop(key)))
    metrics = {k: a.pop(k) for k in list(a) if k.startswith("metric.")}
    if metrics:
        rows.append(("metrics", ", ".join(f"{k[7:]}={v:.6g}" for k, v in metrics.items())))
    rows += [(k, v) for k, v in sorted(a.items())]
    if ck.trainer:
        rows.append(("trainer", ", ".join(f"{k}={v!r}" for k, v in ck.trainer.items())))
    if ck.rng:
        keys = sorted({k for r in ck.rng.values() for k in r})
        rows.append(("rng", f"rank(s) {rank_ranges(list(ck.rng))}: {', '.join(keys)}"))
    state_bytes = sum(arr.nbytes for arr in ck.state.values())
    rows.append(
        ("state", f"{len(ck.state)} arrays, {_mb(state_bytes)} (file data {_mb(ck.nbytes)})")
    )
    for key, value in rows:
        print(f"{key:<11} {value}")
    width = max((len(k) for k in ck.state), default=4)
    print(f"  {'NAME':<{width}}  {'DTYPE':<8} {'SHAPE':<18} SIZE")
    for key, arr in ck.state.items():
        print(f"  {key:<{width}}  {str(arr.dtype):<8} {str(arr.shape):<18} {_mb(arr.nbytes)}")
    if config and not args.no_config:
        print("config:")
        print(textwrap.indent(config.rstrip("\n"), "  "))
    return 0


def _check_out(out: str, force: bool) -> None:
    """OUT is a file path; an existing file is replaced only with --force (a dataset or
    a config given by a slip of tab completion was replaced without a word), and never
    when it is a checkpoint."""
    path = Path(require_path("OUT", out))
    if path.is_dir() or path.name in ("", ".", ".."):
        raise CheckpointError(f"OUT {out} is a directory: give a file name in it")
    _refuse_replacing_a_checkpoint(path)
    if path.exists() and not force:
        raise CheckpointError(f"{out} exists: --force replaces it, or choose another OUT")


def _refuse_replacing_a_checkpoint(out: Path) -> None:
    """An export never replaces a checkpoint (its own input, say): OUT is for weights."""
    try:
        with out.open("rb") as f:
            head = f.read(len(MAGIC))
    except OSError:  # absent (or unreadable: the write will say so)
        return
    if head == MAGIC:
        raise CheckpointError(
            f"{out} is an hpctrain checkpoint and an export would replace it: choose "
            "another OUT file"
        )


def _export_args_problem(args) -> str | None:
    """Export options that would do nothing, or a name that promises another format."""
    if args.keep_layout and args.to != "keras":
        return f"--keep-layout applies to --to keras only, not --to {args.to}"
    name = str(args.out)
    if args.to == "keras" and name.endswith((".keras", ".weights.h5")):
        return (
            f"{args.out}: --to keras writes hpctrain's per-layer weights, read with h5py "
            "(docs/checkpoint-format.md), which keras.models.load_model and Keras's "
            "load_weights (its .keras and .weights.h5 names) cannot read: name it "
            "otherwise (model-keras.h5), or write a whole model with --to keras-model"
        )
    return None


def _export(args) -> int:
    from ..backends import export

    if problem := _export_args_problem(args):
        raise CheckpointError(problem)
    _check_out(args.out, args.force)
    ck = reader.load(args.file)
    weights = ck.model_weights()
    if not weights:
        raise CheckpointError(f"{ck.path}: holds no model weights to export")
    load = None
    if args.to == "torchscript":
        out, spec = export.write_torchscript(weights, args.out, ck.config_yaml, ck.path)
        what = f"TorchScript {spec.name} (zoo) with {len(weights)} tensors, eval mode"
        load = f"torch.jit.load({str(out)!r})"
    elif args.to == "keras-model":
        out, spec = export.write_keras_model(weights, args.out, ck.config_yaml, ck.path)
        what = f"Keras model {spec.name} (zoo) with {len(weights)} tensors"
        load = f"keras.models.load_model({str(out)!r})"
    elif args.to == "torch":
        out = export.write_torch(weights, args.out, ck.config_yaml)
        what = f"torch state_dict of {len(weights)} tensors"
    else:
        out = export.write_keras(
            weights, args.out, ck.config_yaml, args.keep_layout, source=str(ck.path)
        )
        what = f"Keras-layout weights of {len(weights)} arrays"
    print(f"wrote {out}: {what} from step {ck.step} ({_mb(out.stat().st_size)})")
    if load:
        print(f"load with {load}, no hpctrain needed; {spec.input_line()}")
    return 0
