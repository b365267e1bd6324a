"""Run configuration: YAML file + `--set key=value` overrides, validated before any work.

Every key has a declared type, default and (where it matters) a range or a set of
choices. Unknown keys, wrong types and impossible values are all reported together in
one message that names each offending key, so a job never starts with a typo.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from .backends.horovod_env import DEFAULTS as HVD
from .checkpoint.policy import BEST_MODES, section_problems
from .checkpoint.policy import SCHEMA as CHECKPOINT_SCHEMA
from .errors import ConfigError
from .exchange import compression as compression_methods
from .fields import NONNEG, POS_INT, check_value, field
from .strategies import STRATEGIES, composition

_f = field
MAX_THREADS = 4096  # a node's hardware threads, with room (a huge value overflowed C)


TORCH_MAX_SEED = 2**62  # torch.manual_seed takes a signed 64-bit seed; ranks add theirs

SCHEMA: dict[str, Any] = {
    "backend": _f("torch", str, "deep-learning framework", choices=("torch", "tensorflow")),
    "strategy": _f("data_parallel", str, "how ranks share the work", choices=tuple(STRATEGIES)),
    "model": _f({"name": "mlp"}, dict, "model.name plus that model's options", free_form=True),
    "data": {
        "source": _f(
            "synthetic", str, "where batches come from", choices=("synthetic", "hdf5", "benchmark")
        ),
        "path": _f(None, str, "HDF5 file (x/y datasets: see data.keys)", nullable=True),
        "keys": _f(
            None,
            dict,
            "HDF5 paths {train_x, train_y, val_x, val_y}; null: /train/{x,y} + /val/{x,y} "
            "or one pair /x+/y, /images+/labels, /inputs+/targets, /features+/labels, "
            "/data+/labels",
            nullable=True,
            free_form=True,
        ),
        "val_fraction": _f(
            None,
            (int, float),
            "share of samples held out for validation when the file has no validation "
            "split (null: 0.1; 0: none)",
            nullable=True,
            minimum=0,
        ),
        "layout": _f(
            "auto",
            str,
            "how the file stores images (auto: when unambiguous)",
            choices=("auto", "nchw", "nhwc"),
        ),
        "tokens": _f(
            None,
            bool,
            "integer x are token ids (null: when the model is a language model)",
            nullable=True,
        ),
        "x_scale": _f(
            None,
            (int, float),
            "x times this after the float32 cast (null: 1/255 for uint8, else 1)",
            nullable=True,
            minimum=0,
            exclusive_min=True,
        ),
        "inferred": _f(
            None,
            dict,
            "what hpctrain found in the data file (written to the run's config.yaml; "
            "ignored when read)",
            nullable=True,
            free_form=True,
        ),
        "task": _f("vectors", str, "synthetic task", choices=("vectors", "images", "tokens")),
        "train_samples": _f(8192, int, "synthetic training samples", **POS_INT),
        "val_samples": _f(2048, int, "synthetic validation samples", **POS_INT),
        "classes": _f(10, int, "classes of the synthetic classification tasks", minimum=2),
        "features": _f(32, int, "input features of the 'vectors' task", **POS_INT),
        "image_size": _f(16, int, "height = width of the 'images' task", minimum=4),
        "channels": _f(3, int, "channels of the 'images' task", **POS_INT),
        "seq_len": _f(32, int, "sequence length of the 'tokens' task", minimum=2),
        "vocab": _f(64, int, "vocabulary of the 'tokens' task", minimum=2),
        "seed": _f(1234, int, "seed of the synthetic data generator", **NONNEG),
        "prefetch": _f(2, int, "batches read ahead by a background thread", **NONNEG),
        "in_memory_mb": _f(
            256,
            (int, float),
            "a training split of at most this many MiB (x and y) is read once per node "
            "into memory its ranks share and batched from there; a larger one row by row "
            "from the file (0: always from the file)",
            minimum=0,
        ),
    },
    "optimizer": {
        "name": _f("sgd", str, "optimizer", choices=("sgd", "adam")),
        "lr": _f(
            0.05, (int, float), "base learning rate (per-rank batch)", minimum=0, exclusive_min=True
        ),
        "momentum": _f(0.9, (int, float), "SGD momentum", minimum=0, maximum=1, exclusive_max=True),
        "weight_decay": _f(0.0, (int, float), "L2 weight decay", minimum=0),
        "betas": _f([0.9, 0.999], list, "Adam betas"),
        "eps": _f(1e-8, (int, float), "Adam epsilon", minimum=0, exclusive_min=True),
        "lr_scaling": _f(
            "linear",
            str,
            "scale lr with world size (Goyal et al.)",
            choices=("none", "linear", "sqrt"),
        ),
        "warmup_epochs": _f(
            0.0, (int, float), "linear warm-up from base lr to scaled lr", **NONNEG
        ),
        "schedule": _f("constant", str, "lr after warm-up", choices=("constant", "cosine")),
        "resume_schedule": _f(
            "stretch",
            str,
            "a resume with another train.epochs/max_steps: stretch the cosine over the new "
            "length, or continue the checkpoint's schedule (then its final lr)",
            choices=("stretch", "continue"),
        ),
    },
    "train": {
        "epochs": _f(1, int, "passes over the training set", **POS_INT),
        "max_steps": _f(
            None, int, "stop after this many optimizer steps", nullable=True, **POS_INT
        ),
        "batch_size": _f(64, int, "samples per rank per micro-batch", **POS_INT),
        "grad_accum": _f(1, int, "micro-batches per optimizer step", **POS_INT),
        "seed": _f(0, int, "seed for weights, shuffling and dropout", **NONNEG),
        "clip_norm": _f(
            None,
            (int, float),
            "global gradient-norm clipping",
            nullable=True,
            minimum=0,
            exclusive_min=True,
        ),
        "compression": _f(
            "none",
            str,
            "gradient compression on the wire (options in the compression section)",
            choices=compression_methods.METHODS,
        ),
        "hierarchical": _f(
            False,
            bool,
            "MPI engines: reduce inside each node, allreduce across node leaders, "
            "broadcast inside the node",
        ),
        "bucket_mb": _f(
            1.0,
            (int, float),
            "overlap, nccl and gloo engines: MB of gradients per allreduce started from backward",
            minimum=0,
            exclusive_min=True,
        ),
        "precision": _f(
            "fp32",
            str,
            "compute precision: bf16 runs forward/backward in bfloat16 (torch autocast, "
            "TensorFlow casts) with float32 master weights, gradients and optimizer state; "
            "fp16 (torch) in float16 with dynamic loss scaling (an overflow skips the step "
            "on every rank; the scale is checkpointed)",
            choices=("fp32", "bf16", "fp16"),
        ),
        "zero": _f(
            0,
            int,
            "ZeRO sharding over the data ranks (MPI engine; gloo/nccl process groups, "
            "which GPU ranks need): 0 off, 1 optimizer state, "
            "2 optimizer state and gradients, 3 also the parameters (gathered per unit of "
            "layers ahead of use; torch)",
            choices=(0, 1, 2, 3),
        ),
        "zero_unit_mb": _f(
            16.0,
            (int, float),
            "ZeRO-3: MB of parameters gathered at once (consecutive layers form a unit); "
            "two units are live at a time, the running one and the prefetched one",
            minimum=0,
            exclusive_min=True,
        ),
        "offload": _f(
            "none",
            str,
            "ZeRO on GPU ranks: keep the shard's float32 master copy and optimizer state "
            "in host memory, updated by the CPU (optimizer); with ZeRO-3 the parameter "
            "shard too, staged to the GPU for each gather (optimizer+params); on CPU "
            "ranks only none (their state is in host memory already)",
            choices=("none", "optimizer", "optimizer+params"),
        ),
        "zero_prefetch": _f(
            True,
            bool,
            "ZeRO-3: gather the next unit's parameters while the current one computes",
        ),
        "sync_every": _f(
            1, int, "local SGD: average parameters every H steps (1: synchronous)", **POS_INT
        ),
        "local_sgd_warmup_steps": _f(
            0, int, "post-local SGD: synchronous steps before local SGD starts", **NONNEG
        ),
        "allreduce": _f(
            "auto",
            str,
            "gradient averaging: horovod (background engine), mpi (one MPI_Allreduce after "
            "backward), overlap (MPI buckets from backward hooks), nccl / gloo "
            "(torch.distributed process groups bootstrapped over MPI, on the device), auto "
            "(nccl on GPU ranks, mpi or gloo where ranks share a GPU; on CPU mpi for what "
            "only it runs (ZeRO, compression, fp16 precision, ...) or when ranks x threads "
            "fill the node's cores or Horovod is missing, else horovod)",
            choices=("auto", "horovod", "mpi", "overlap", "nccl", "gloo"),
        ),
        "eval_every_epochs": _f(1, int, "validate every N epochs", **POS_INT),
        "log_every": _f(10, int, "log a progress line every N steps", **POS_INT),
        "nan_check": _f(True, bool, "stop with a clear error when the loss is NaN/inf"),
        "overlap_step_metrics": _f(
            True, bool, "reduce a step's loss and flags during the next step (one sync per step)"
        ),
        "deterministic": _f(True, bool, "deterministic kernels (needed for bit-exact resume)"),
    },
    "compression": {
        "ratio": _f(
            0.1,
            (int, float),
            "topk/randomk: share of gradient entries sent, k = max(1, int(n x ratio))",
            minimum=0,
            exclusive_min=True,
            maximum=1,
        ),
        "rank": _f(4, int, "powersgd: rank r of the low-rank approximation", **POS_INT),
        "error_feedback": _f(
            True, bool, "lossy methods: add what was not sent to the next step's gradient"
        ),
        "warmup_steps": _f(
            0,
            int,
            "lossy methods: dense (uncompressed) steps before compression starts",
            **NONNEG,
        ),
    },
    "horovod": {
        "fusion_threshold_mb": _f(
            HVD["fusion_threshold_mb"], (int, float), "HOROVOD_FUSION_THRESHOLD", **NONNEG
        ),
        "cycle_time_ms": _f(HVD["cycle_time_ms"], (int, float), "HOROVOD_CYCLE_TIME", **NONNEG),
        "hierarchical_allreduce": _f(
            HVD["hierarchical_allreduce"], bool, "HOROVOD_HIERARCHICAL_ALLREDUCE"
        ),
        "timeline": _f(
            HVD["timeline"],
            str,
            "HOROVOD_TIMELINE file (Chrome trace), written by rank 0: its directory must exist",
            nullable=True,
        ),
        "autotune": _f(HVD["autotune"], bool, "HOROVOD_AUTOTUNE"),
    },
    "runtime": {
        "device": _f(
            "auto",
            str,
            "where each rank computes: cuda (one GPU per rank: the only one it sees, else one "
            "each among those the node's ranks see, by node-local rank where all see every "
            "GPU), cpu, or auto (cuda when torch sees a GPU and the layout runs on GPUs)",
            choices=("auto", "cpu", "cuda"),
        ),
        "collective_timeout": _f(
            600.0,
            (int, float),
            "seconds before the watchdog ends a stuck collective (at least 1: its monitor "
            "looks once a second)",
            minimum=1,
        ),
        "startup_timeout": _f(
            600.0,
            (int, float),
            "seconds a wait before the first step may take when longer than "
            "collective_timeout (ranks import, build and read data at their own pace); a "
            "stopped rank is still named at every collective_timeout",
            minimum=1,
        ),
        "stall_warning": _f(
            60.0,
            (int, float),
            "seconds a collective may wait before the watchdog warns, naming the ranks "
            "that have not arrived (0: never; else at least 1, the monitor's poll); a wait "
            "with a deadline of its own (a checkpoint write's) warns at half of it",
            minimum=0,
        ),
        "max_requeues": _f(
            10,
            int,
            "SLURM: a preempted or timed-out job requeues itself until it has been "
            "requeued this many times (SLURM_RESTART_COUNT); then it ends, checkpoint kept",
            **NONNEG,
        ),
        "threads": _f(
            None,
            int,
            "compute threads per rank (default: launcher or cores/ranks)",
            nullable=True,
            **POS_INT,
            maximum=MAX_THREADS,
        ),
        "mpi_yield_when_idle": _f(
            True, bool, "Open MPI yields the core while waiting (oversubscription)"
        ),
        "tcp_links": _f(
            2,
            int,
            "Open MPI TCP connections per peer (btl_tcp_links; a launcher's --mca wins): "
            "one connection carries one direction at a time at 1 Gbit/s",
            **POS_INT,
        ),
        "malloc_keep_freed": _f(
            True, bool, "glibc malloc keeps freed memory for reuse (no page faults per step)"
        ),
        "memory_check": _f(
            True,
            bool,
            "before training, refuse a data-parallel run whose parameters, gradients and "
            "optimizer state will not fit the rank's memory limit (cgroup, SLURM --mem or "
            "--mem-per-cpu, runtime.memory_limit_mb), naming the figures",
        ),
        "memory_limit_mb": _f(
            None,
            (int, float),
            "per-rank memory limit in MiB to plan against (null: the cgroup's and SLURM's)",
            nullable=True,
            minimum=0,
            exclusive_min=True,
        ),
    },
    "ps": {
        "servers": _f(
            1, int, "parameter-server ranks (the last ones; the rest are workers)", **POS_INT
        ),
        "mode": _f("sync", str, "consistency of the updates", choices=("sync", "async", "bounded")),
        "staleness_bound": _f(
            10, int, "bounded: reject gradients more versions old than this", **NONNEG
        ),
        "staleness_decay": _f(
            0.1,
            (int, float),
            "bounded: a gradient s versions old is scaled by 1/(1+decay*s)",
            **NONNEG,
        ),
        "heartbeat_timeout": _f(
            60.0,
            (int, float),
            "seconds without a message before a worker is dropped",
            minimum=1,  # the watchdog looks once a second, as for collective_timeout
        ),
        "chunk_bytes": _f(
            1 << 20, int, "tensors larger than this are split across servers", minimum=4
        ),
        "poll_max_sleep_ms": _f(
            1.0,
            (int, float),
            "longest sleep between polls while waiting (no busy-wait)",
            **NONNEG,
        ),
        "backends": _f(
            None,
            list,
            "per-worker backends, cycled (default: every worker uses `backend`)",
            nullable=True,
        ),
    },
    "pipeline": {
        "stages": _f(
            2,
            int,
            "pipeline stages P (ranks = P x parallel.tensor x data-parallel replicas)",
            **POS_INT,
        ),
        "microbatches": _f(4, int, "micro-batches m per step (train.batch_size each)", **POS_INT),
        "schedule": _f("1f1b", str, "micro-batch schedule", choices=("gpipe", "1f1b")),
        "partition": _f("parameters", (str, list), "parameters | time | [layers per stage, ...]"),
    },
    "parallel": {
        "tensor": _f(
            1,
            int,
            "tensor-parallel degree: each transformer block's heads and MLP split over this "
            "many consecutive ranks (Megatron), inside each pipeline stage under strategy "
            "pipeline; the rest of the job replicates the groups",
            **POS_INT,
        ),
        "expert": _f(
            None,
            int,
            "ranks per expert-parallel group (MoE models; the rest of the job replicates "
            "the groups; x parallel.tensor with tensor parallelism); null: the whole job "
            "(a pipeline: each stage's replicas)",
            nullable=True,
            **POS_INT,
        ),
    },
    "checkpoint": CHECKPOINT_SCHEMA,
    "metrics": {
        "jsonl": _f(True, bool, "write <run-dir>/metrics.jsonl"),
        "tensorboard": _f(True, bool, "write TensorBoard scalars under <run-dir>/tb"),
        "progress_bar": _f(True, bool, "tqdm bar on rank 0 when stderr is a terminal"),
    },
}


def timeline_problem(timeline: str | None) -> str | None:
    """Why Horovod cannot write its timeline to `timeline`: a directory, or a missing one
    (Horovod says so in a C++ error line, writes nothing, and the run goes on), or a file
    that is not an earlier timeline (Horovod truncates it: a typo cost a user's file)."""
    if not timeline:
        return None
    path = Path(timeline)
    if path.is_dir() or not path.parent.is_dir():
        what = "is a directory" if path.is_dir() else "its directory does not exist"
        return f"horovod.timeline: {timeline} {what}: it names a file to write"
    if path.exists():
        try:
            with path.open("rb") as f:
                head = f.read(64).lstrip()
        except OSError as exc:
            return f"horovod.timeline: {timeline}: cannot read it ({exc.strerror})"
        if head and not head.startswith(b"["):  # Horovod's timelines are JSON arrays
            return (
                f"horovod.timeline: {timeline} exists and is not a Horovod timeline: Horovod "
                "would overwrite it; name a new file (an earlier timeline is overwritten)"
            )
    return None


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 numbers (PyYAML, YAML 1.1, reads `1e-4` as a string, `017` as
    15 and `1:30` as 90, and `0o17` not as a number) and no duplicate keys (PyYAML keeps
    the last silently: a second `train:` section dropped the first's settings). Merge
    keys (`<<: *defaults`) work as in PyYAML: a key of the mapping itself overrides a
    merged one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged by SafeLoader below (its keys may be overridden)
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # a list or mapping as a key (`? [1, 2]`)
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain value, got {key!r}", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
# YAML 1.2 has no timestamps: `checkpoint.resume: 2024-01-01` (a file of that name) was
# read as a date and refused as "expected str, got date"; its integers are below
_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:int")
    ]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^[-+]?(?:0b[01_]+|0o[0-7_]+|0x[0-9a-fA-F_]+|[0-9][0-9_]*)$"),
    list("-+0123456789"),
)


def _construct_int(loader: yaml.SafeLoader, node) -> int:
    """YAML 1.2's integers (with 1.1's `_` separators and `0b`): `017` is 17, `0o17` 15."""
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    base = {"0b": 2, "0o": 8, "0x": 16}.get(digits[:2], 10)
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:  # `!!int abc`
        raise _not_a("an integer", node) from None


def _construct_float(loader: yaml.SafeLoader, node) -> float:
    try:
        return yaml.SafeLoader.construct_yaml_float(loader, node)
    except ValueError:  # `!!float abc`
        raise _not_a("a number", node) from None


def _not_a(kind: str, node) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(
        None, None, f"{node.value!r} is not {kind}", node.start_mark
    )


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _defaults(schema: dict) -> dict:
    out = {}
    for key, spec in schema.items():
        out[key] = _defaults(spec) if isinstance(spec, dict) else copy.deepcopy(spec.default)
    return out


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _validate(schema: dict, values: dict, prefix: str, problems: list[str]) -> None:
    for key in values:
        if key not in schema:
            known = ", ".join(sorted(schema))
            near = difflib.get_close_matches(str(key), list(schema), n=1, cutoff=0.7)
            hint = f"did you mean {prefix}{near[0]}? " if near else ""
            problems.append(f"{prefix}{key}: unknown key ({hint}known here: {known})")
    for key, spec in schema.items():
        full = f"{prefix}{key}"
        value = values.get(key)
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                problems.append(f"{full}: expected a mapping, got {type(value).__name__}")
            else:
                _validate(spec, value, full + ".", problems)
        else:
            problem = check_value(full, spec, value)
            if problem:
                problems.append(problem)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML, so 0.1 is a float, [1,2] a list)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    parts = [part.strip() for part in key.split(".")]  # `train. batch_size=4` too
    if not all(parts):
        raise ConfigError(f"--set {text!r}: empty key component")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc})") from None
    return parts, value


def _apply_overrides(values: dict, overrides: list[str]) -> dict[str, str]:
    """Set each `key=value` in `values`; {dotted key: the --set text}, so a problem with
    a key names the override it came from, not the file."""
    origins: dict[str, str] = {}
    for text in overrides:
        parts, value = parse_override(text)
        node = values
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {part} is not a section")
        node[parts[-1]] = value
        origins[".".join(parts)] = text
    return origins


def mpi_start_settings(path: str | Path | None, overrides: list[str]) -> tuple[bool, int]:
    """runtime.mpi_yield_when_idle and runtime.tcp_links, read as far as a configuration
    that failed to load allows: each valid value the file and then each --set give, in
    order (an invalid one is what failed, and the peers that loaded do not have it), a
    default where none is. A rank whose configuration failed still starts MPI with what
    its peers start with: Open MPI ranks started with different TCP settings never
    finish their first communicator (measured: both ranks spun in `Split_type`, the
    agreed error never came). Not covered: a rank whose own copy of the file is
    missing or differs (a launcher's --mca btl_tcp_links, which wins on every rank,
    removes even that)."""
    spec = SCHEMA["runtime"]
    out = {key: spec[key].default for key in ("mpi_yield_when_idle", "tcp_links")}

    def take(section, whole: bool = False) -> None:
        if not isinstance(section, dict):
            return
        if whole:  # `--set runtime={...}` replaces the section: the rest is default
            out.update({key: spec[key].default for key in out})
        for key in out:  # the schema's own check: what Config.load would accept
            if key in section and check_value(key, spec[key], section[key]) is None:
                out[key] = section[key]

    try:
        values = _yaml_load(Path(path).read_text(encoding="utf-8")) if path else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        values = {}
    take(values.get("runtime") if isinstance(values, dict) else None)
    for text in overrides:
        one: dict = {}
        try:
            _apply_overrides(one, [text])
        except (ConfigError, AttributeError, yaml.YAMLError):
            continue
        take(one.get("runtime"), whole=text.split("=", 1)[0].strip() == "runtime")
    return out["mpi_yield_when_idle"], out["tcp_links"]


def _with_origin(problem: str, origins: dict[str, str]) -> str:
    """`problem` naming the --set overrides of the key it is about (the key it starts
    with, a section around it or a key inside it): a user looks for it there, not in
    the file."""
    match = re.match(r"[\w.]+", problem)
    key = match.group() if match else ""
    # what it clashes with ("not with strategy pipeline, train.zero=2"), not its hints
    clash = problem.split("not with ", 1)[1] if "not with " in problem else ""
    texts = [
        text
        for k, text in origins.items()
        if key
        and (k == key or key.startswith(k + ".") or k.startswith(key + "."))
        or re.search(rf"(?<![\w.]){re.escape(k)}[= ]", clash)
    ]
    if not texts:
        return problem
    where = "from " + ", ".join(f"--set {text}" for text in texts)
    if ": unknown key (" in problem:  # before its long list of the keys known there
        return problem.replace(": unknown key (", f": unknown key ({where}; ", 1)
    return f"{problem} ({where})"


class Config:
    """A validated configuration; read values as `cfg["train"]["batch_size"]` or `cfg.train`."""

    def __init__(
        self,
        values: dict | None = None,
        source: str = "<defaults>",
        origins: dict[str, str] | None = None,
    ):
        """`origins`: {dotted key: its --set text}, named by the problems they cause."""
        merged = _merge(_defaults(SCHEMA), values or {})
        self.source = source
        problems: list[str] = []
        _validate(SCHEMA, merged, "", problems)
        if isinstance(merged.get("model"), dict):
            from .models.zoo import validate_model_options  # framework-neutral

            problems += validate_model_options(merged["model"])
        if not problems:
            problems += _cross_checks(merged)
        if problems:
            lines = [_with_origin(problem, origins or {}) for problem in problems]
            raise ConfigError(f"invalid configuration ({source}):\n  " + "\n  ".join(lines))
        self._values = merged

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
        values: dict = {}
        source = "<defaults>"
        if path is not None:
            path = Path(path)
            source = str(path)
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                raise ConfigError(f"config file not found: {path}") from None
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); "
                    "--config takes a YAML file"
                ) from None
            except OSError as exc:
                raise ConfigError(f"cannot read config file {path}: {exc}") from None
            try:
                values = _yaml_load(text) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from None
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top level must be a mapping of keys")
        origins = _apply_overrides(values, overrides or [])
        return cls(values, source, origins)

    def __getitem__(self, key):
        return self._values[key]

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(key) from None

    def to_dict(self) -> dict:
        return copy.deepcopy(self._values)

    def recorded(self) -> dict:
        """The values as a run records them (its config.yaml, a checkpoint's config_yaml,
        `hpctrain config`): a zoo model's own defaults filled in too (zoo.written_model)."""
        from .models.zoo import written_model

        values = self.to_dict()
        values["model"] = written_model(values["model"])
        return values

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.recorded(), sort_keys=True)

    def replace(self, overrides: list[str]) -> Config:
        """A copy with `key=value` overrides applied (validated again)."""
        values = self.to_dict()
        return Config(values, self.source, _apply_overrides(values, overrides))


def _cross_checks(v: dict) -> list[str]:
    """Values that only make sense together: the config's own (checkpoint, optimizer,
    data, model x task), then the rules of composition (strategies/composition.py)."""
    problems = []
    problems += section_problems(v["checkpoint"])
    best = v["checkpoint"]["best_metric"]
    if v["checkpoint"]["keep_best"] and best not in BEST_MODES:
        problems.append(
            f"checkpoint.best_metric: {best!r} is not a metric a run records "
            f"({', '.join(BEST_MODES)}): keep_best would find it in no checkpoint and keep none"
        )
    from .data.synthetic import MAX_SEED  # the synthetic file's seed attribute: a uint64

    for key, most in (("train", TORCH_MAX_SEED), ("data", MAX_SEED)):
        if v[key]["seed"] > most:
            problems.append(f"{key}.seed: expected 0 to {most}, got {v[key]['seed']}")
    warn = v["runtime"]["stall_warning"]
    if 0 < warn < 1:  # every collective would probe every rank
        problems.append(f"runtime.stall_warning: expected 0 (never) or at least 1 s, got {warn!r}")
    betas = v["optimizer"]["betas"]
    if not (len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        problems.append(f"optimizer.betas: expected two numbers in [0, 1), got {betas!r}")
    problems += composition.refusals(v)
    problems += filter(None, [timeline_problem(v["horovod"]["timeline"])])
    if v["strategy"] == "pipeline":
        problems += filter(None, [_partition_problem(v)])
    if v["data"]["source"] == "hdf5" and not v["data"]["path"]:
        problems.append("data.path: required when data.source is hdf5")
    from .data.keys import validate_keys_option

    problems += validate_keys_option(v["data"]["keys"])
    if v["data"]["val_fraction"] is not None and v["data"]["val_fraction"] >= 1:
        problems.append(f"data.val_fraction: must be below 1, got {v['data']['val_fraction']!r}")
    from .models.zoo import MODEL_TASK

    name = v["model"]["name"]
    if (
        name in MODEL_TASK
        and v["data"]["source"] != "hdf5"
        and v["data"]["task"] not in MODEL_TASK[name]
    ):
        problems.append(
            f"data.task: model {name} needs data.task "
            f"{' or '.join(MODEL_TASK[name])}, got {v['data']['task']}"
        )
    return problems


def _partition_problem(v: dict) -> str | None:
    """`pipeline.partition` and `pipeline.stages` against the model's layers, for a zoo
    model on generated data (its layers are known from the config alone: shapes, no
    weights); a model fed from an HDF5 file or the user's is checked when it is built."""
    from .models.zoo import build_layers, is_zoo_model
    from .pipeline.partition import check_partition, spec_problem

    spec, stages = v["pipeline"]["partition"], v["pipeline"]["stages"]
    if not is_zoo_model(v["model"]["name"]) or v["data"]["source"] == "hdf5":
        return spec_problem(spec, stages)
    from .data import benchmark_input_spec

    layers = build_layers(v["model"], benchmark_input_spec(v["data"]))
    return check_partition(spec, len(layers), stages)


def _show(value) -> str:
    """A default as a user would type it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value).replace('"', "")
    return str(value)


def describe_schema(schema: dict | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) rows for --help and docs/reference/configuration.md."""
    rows = []
    for key, spec in (schema or SCHEMA).items():
        if isinstance(spec, dict):
            rows += describe_schema(spec, f"{prefix}{key}.")
        else:
            default = spec.default
            if spec.choices:
                doc = f"{spec.doc} ({' | '.join(map(str, spec.choices))})"
            else:
                doc = spec.doc
            rows.append((prefix + key, _show(default), doc))
    return rows
