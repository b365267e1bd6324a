"""The `hpctrain` command. Works unchanged under mpirun, srun and horovodrun.

Every subcommand runs inside `run_fail_together`: a user error every rank agreed on is
printed once, by rank 0, as one clear line naming the ranks it concerns, and every rank
exits 2; a crash on any rank aborts the whole job instead of leaving the other ranks
waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import sys
import textwrap
from pathlib import Path

from . import memory_report
from .version import __version__

# Feature packages that add subcommands: each module has
# `register(subparsers) -> {command name: handler(args) -> exit code}`.
# command modules whose import failed (a package missing): name -> the error
UNLOADABLE: dict[str, str] = {}

COMMAND_MODULES: list[str] = [
    "hpctrain.slurm.cli",
    "hpctrain.checkpoint.cli",
    "hpctrain.cluster.cli",
    "hpctrain.elastic.cli",
]

LAUNCH_HELP = """\
launch:
  mpirun -np 4 hpctrain train --config configs/demo.yaml
  srun --mpi=pmix -n 4 hpctrain train --config configs/demo.yaml
  horovodrun -np 4 hpctrain train --config configs/demo.yaml
  hpctrain elastic --hostfile hosts --max-restarts 3 -- train --config configs/demo.yaml --run-dir runs/demo
  (as root add --allow-run-as-root; more ranks than cores need mpirun --oversubscribe)
"""


def _config_help() -> str:
    from .config import describe_schema

    rows = describe_schema()
    width = max(len(k) for k, _, _ in rows)
    lines = [f"  {k:<{width}}  {d:<10} {doc}" for k, d, doc in rows]
    return "configuration keys (YAML file, or --set key=value):\n" + "\n".join(lines)


def _add_config_args(p: argparse.ArgumentParser):
    p.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="YAML configuration (defaults are used for keys it leaves out)",
    )
    p.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set train.batch_size=128 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="MPI-launched training for PyTorch and TensorFlow: data parallelism "
        "(Horovod, MPI, NCCL/Gloo), ZeRO 1-3, tensor, pipeline and expert parallelism, "
        "parameter servers; HDF5 data, metrics and checkpoints. CPU ranks run all of it; "
        "GPU ranks (torch) run dense data parallelism; ZeRO, offload, tensor, pipeline "
        "and expert parallelism, compression and train.allreduce=gloo there wait for the "
        "GPU check "
        "(HPCTRAIN_GPU_UNTESTED=1 lets them run); "
        "the parameter server, hierarchical allreduce and local SGD stay on CPU ranks "
        "(docs/gpu.md).",
        epilog=LAUNCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "doctor",
        help="check the installed stack and show the rank layout",
        description="Check Python, MPI/mpi4py, h5py, torch, TensorFlow and "
        "Horovod; under a launcher, print every rank's layout. "
        "Exits 1 naming anything missing.",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print only problems")

    _add_train_commands(sub)

    p = sub.add_parser(
        "config",
        help="print the resolved configuration (after --set)",
        description="Validate a configuration and print it with defaults filled "
        "in (a zoo model's own options too), without starting MPI. With --np N, check too that N ranks can run it (the "
        "rules `hpctrain slurm render` checks: pipeline stages x tensor ranks, parameter "
        "servers, experts, one global batch from the training split). What only the "
        "job's nodes can tell (a data file or model module this host lacks) is named on "
        "stderr as not checked here.",
    )
    _add_config_args(p)
    p.add_argument(
        "--np",
        type=int,
        metavar="N",
        help="also check that a job of N ranks can run this configuration",
    )

    _add_data_command(sub)
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a broken install: `doctor` must still run and say so
            UNLOADABLE[module_name] = f"{type(exc).__name__}: {exc}"
            continue
        COMMANDS.update(module.register(sub))
    COMMANDS.update(memory_report.register(sub, _add_config_args))
    return parser


def _add_train_commands(sub) -> None:
    """`train` and `ps`: the same options (a config, a run directory, resume, reuse)."""
    for name, help_text, description in (
        (
            "train",
            "train a model (strategy: data_parallel, pipeline or parameter_server; "
            "ZeRO, tensor and expert parallelism inside the first two)",
            "Train the configured model on every rank of the job with the configured "
            "strategy. Writes config.yaml, metrics.jsonl and TensorBoard scalars into the "
            "run directory.",
        ),
        (
            "ps",
            "train with parameter servers (the last ps.servers ranks serve)",
            "Parameter-server training over MPI, the same as `train` with strategy: "
            "parameter_server. The last ps.servers ranks hold the parameters and the "
            "optimizer, the other ranks compute gradients. ps.mode: sync (equal to "
            "data-parallel SGD), async, or bounded (stale gradients scaled by "
            "1/(1+decay*s), rejected beyond ps.staleness_bound).",
        ),
    ):
        p = sub.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=_config_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_config_args(p)
        p.add_argument(
            "--run-dir",
            metavar="DIR",
            help="output directory (default runs/<config name>-<UTC time>)",
        )
        p.add_argument("--verbose", "-v", action="store_true", help="log from every rank")
        p.add_argument(
            "--resume",
            metavar="auto|never|FILE",
            help="continue from a checkpoint (of any strategy): 'auto' takes the newest one "
            "in the checkpoint directory that verifies (skipping damaged ones) when the run "
            "there has this configuration, FILE takes that one (default: "
            "checkpoint.resume, which is 'never')",
        )
        reuse = p.add_mutually_exclusive_group()
        reuse.add_argument(
            "--overwrite",
            action="store_true",
            help="the run directory holds an earlier run: delete what it wrote (checkpoints "
            "and their shard folders, metrics.jsonl, config.yaml, TensorBoard's event files)",
        )
        reuse.add_argument(
            "--new",
            action="store_true",
            help="the run directory holds an earlier run: move what it wrote to "
            "<run-dir>/previous/<UTC>",
        )


class _DescriptionAndDefaults(
    argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
    """The description as written, each option's default after its help."""


def _add_data_command(sub) -> None:
    """`data synth`: a learnable synthetic HDF5 dataset."""
    p = sub.add_parser("data", help="dataset tools")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    s = dsub.add_parser(
        "synth",
        help="write a learnable synthetic dataset to HDF5",
        description=textwrap.dedent("""\
                        Write /train/{x,y} and /val/{x,y} for one of the synthetic tasks:
                          vectors  Gaussian inputs labelled by a random teacher MLP (for mlp)
                          images   noisy shifted class templates, NCHW (for cnn, resnet)
                          tokens   sequences of a random Markov chain (for transformer)"""),
        formatter_class=_DescriptionAndDefaults,
    )
    s.add_argument(
        "output",
        help="HDF5 file to write, in a directory that exists (refused if the file exists, "
        "unless --force)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="replace the output file when it exists (its data is lost)",
    )
    s.add_argument(
        "--task", choices=("vectors", "images", "tokens"), default="vectors", help="the task"
    )
    s.add_argument("--train", type=int, default=8192, help="training samples")
    s.add_argument("--val", type=int, default=2048, help="validation samples (0: none)")
    s.add_argument("--seed", type=int, default=1234, help="the generator's seed")
    s.add_argument("--classes", type=int, default=10, help="classes (vectors, images)")
    s.add_argument("--features", type=int, default=32, help="features per sample (vectors)")
    s.add_argument("--image-size", type=int, default=16, help="image height and width (images)")
    s.add_argument("--channels", type=int, default=3, help="image channels (images)")
    s.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (tokens)")
    s.add_argument("--vocab", type=int, default=64, help="vocabulary, 2 or more (tokens)")


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor(quiet=args.quiet)


def _load_config_everywhere(args):
    """Load the config on every rank; if any rank fails, every rank reports it."""
    from .config import Config, mpi_start_settings
    from .errors import HpctrainError
    from .loop import prepare_process
    from .runtime import world
    from .runtime.openmpi import OpenMpiDefaults

    cfg, error = None, None
    try:
        if args.command == "ps":  # said once, agreed like the configuration's errors
            _refuse_another_strategy_for_ps(args)
            args.overrides = [*args.overrides, "strategy=parameter_server"]
        cfg = Config.load(args.config, args.overrides)
    except HpctrainError as exc:
        error = str(exc)
    if cfg is not None:
        w = prepare_process(cfg)
    else:  # MPI started as the peers whose configuration loaded start it
        yield_idle, links = mpi_start_settings(args.config, args.overrides)
        w = world(openmpi=OpenMpiDefaults(yield_when_idle=yield_idle, tcp_links=links))
    w.agree(error)
    return cfg


def _cmd_train(args) -> int:
    from . import rundir
    from .errors import ConfigError, require_path
    from .loop import TrainingLoop
    from .runtime.faults import Faults
    from .runtime.preemption import interrupt_exit_code

    if args.run_dir is not None:
        require_path("--run-dir", args.run_dir, "directory")
    if args.resume is not None and not args.resume.strip():  # ('' read as the file '.')
        raise ConfigError(f"--resume {args.resume!r} is blank: auto, never or a file")
    cfg = _load_config_everywhere(args)
    try:
        loop = TrainingLoop(
            cfg,
            run_dir=args.run_dir,
            verbose=args.verbose,
            resume=args.resume,
            overwrite=args.overwrite,
            new=args.new,
            # Test-only: faults a test switched on with HPCTRAIN_FAULT_* (none otherwise;
            # docs/environment.md). The one place they are read.
            faults=Faults.from_env(),
        )
    except BaseException:
        # Refused (a missing file, a model that does not fit) before writing anything: no
        # empty run directory is left behind. Only directories it created, only empty ones.
        rundir.remove_unused_run_dir()
        raise
    rundir.keep_run_dir()
    summary = loop.fit()
    # Interrupted (Ctrl-C, or mpirun's SIGTERM outside SLURM) after its checkpoint: the
    # shell's convention, 128 + the signal's number (130 for SIGINT).
    return interrupt_exit_code(summary.get("preempted"))


def _cmd_config(args) -> int:
    from .config import Config
    from .errors import ConfigError

    cfg = Config.load(args.config, args.overrides)
    if args.np is not None and args.np < 1:
        raise ConfigError(f"--np {args.np}: expected a number of ranks, 1 or more")
    notes = _not_checked_here(cfg)
    if args.np is not None:  # the same rules the job applies at start, before it queues
        from .slurm.fit import training_split, world_size_problems

        split = training_split(cfg)
        problems = world_size_problems(cfg, args.np, f"--np {args.np}", split)
        if problems:
            raise ConfigError("; ".join(problems))
        if split is None and cfg.data["source"] == "hdf5":
            notes.append(f"--np {args.np}: whether the training split fills a global batch")
    for note in notes:
        print(f"note: not checked on this host: {note}", file=sys.stderr)
    # the first line keeps a copy saved as a run's config.yaml from passing for one an
    # earlier hpctrain wrote (the plain dump), which a later run in that directory replaces
    print(f"# hpctrain config: {cfg.source} with defaults filled in")
    print(cfg.to_yaml(), end="")  # as the run's config.yaml has it
    return 0


def _refuse_another_strategy_for_ps(args) -> None:
    """`hpctrain ps` is `train` with strategy parameter_server: a configuration that asks
    for another layout (pipeline, say) trained as a parameter server without a word.
    data_parallel is what a plain config has, and `ps` turns it into the server's."""
    import yaml

    from .config import _yaml_load, parse_override
    from .errors import ConfigError

    asked, where = None, None
    if args.config:  # read as Config.load reads it; what is wrong with it, it says
        with contextlib.suppress(OSError, ValueError, yaml.YAMLError, ConfigError):
            text = _yaml_load(Path(args.config).read_text(encoding="utf-8"))
            if isinstance(text, dict) and "strategy" in text:
                asked, where = text["strategy"], f"{args.config} sets"
    for override in args.overrides:
        with contextlib.suppress(ConfigError):  # a malformed one: Config.load says so
            key, value = parse_override(override)
            if key == ["strategy"]:
                asked, where = value, "--set"
    if asked in (None, "data_parallel", "parameter_server"):
        return
    raise ConfigError(
        f"hpctrain ps trains a parameter server, and {where} strategy: {asked}: run it with "
        "hpctrain train, or set strategy: parameter_server"
    )


def _not_checked_here(cfg) -> list[str]:
    """What the run checks at start that this host cannot (the job's nodes may see other
    files and another PYTHONPATH): a missing data file, a model module not installed
    here. A module that is here is imported and its function's options checked: a
    failing import or an option it lacks is a ConfigError, as the run would refuse."""
    from .data import expand_path
    from .errors import DataError
    from .models.user import ModelNotFound, builder_kwargs, resolve
    from .models.zoo import is_zoo_model

    notes = []
    data = cfg.data
    if data["source"] == "hdf5":
        try:
            if not expand_path(data["path"], "data.path").is_file():
                notes.append(f"data.path {data['path']}: no such file here")
        except DataError as exc:  # an unset variable in it, named
            notes.append(str(exc))
    name = cfg.model["name"]
    if not is_zoo_model(name):
        try:
            fn = resolve(name)
        except ModelNotFound as exc:  # not importable here; one that fails otherwise: refused
            notes.append(str(exc))
        else:  # the data's facts are unknown here: stand-ins, as only options are checked
            builder_kwargs(fn, cfg.model, input_shape=(1,), classes=2)
    return notes


def _cmd_data(args) -> int:
    from .data.synthetic import generate, write_dataset
    from .errors import DataError

    if not _first_on_its_node():
        return 0  # under a launcher each node's first rank writes (node-local paths too)
    _check_synth_args(args)
    _refuse_existing_output(Path(args.output), args.force)
    splits, attrs = generate(
        args.task,
        args.train,
        args.val,
        args.seed,
        classes=args.classes,
        features=args.features,
        image_size=args.image_size,
        channels=args.channels,
        seq_len=args.seq_len,
        vocab=args.vocab,
    )
    try:
        path = write_dataset(args.output, splits, attrs)
    except OSError as exc:  # not the full disk (a DataError): permissions, a bad path
        raise DataError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    shape = splits["train"][0].shape[1:]
    extra = (
        f", best possible accuracy {attrs['bayes_accuracy']:.3f}"
        if "bayes_accuracy" in attrs
        else ""
    )
    print(
        f"wrote {path}: task {args.task}, {args.train} train + {args.val} val samples of "
        f"shape {shape}, {attrs['classes']} classes{extra}"
    )
    return 0


def _check_synth_args(args) -> None:
    """`data synth`'s numbers, checked before anything is generated or written: counts,
    the seed's range, two classes or more, and arrays that fit in this machine's memory."""
    from .data.synthetic import MAX_SEED, memory_problem
    from .errors import ConfigError

    lowest = dict.fromkeys(("train", "features", "image_size", "channels", "seq_len"), 1)
    tokens = args.task == "tokens"  # vocab: the tokens task's only
    lowest.update(val=0, vocab=2 if tokens else 1, classes=1 if tokens else 2)
    for name, least in lowest.items():
        value = getattr(args, name)
        if value < least:
            need = "0 or more (0: no validation split)" if name == "val" else f"{least} or more"
            raise ConfigError(f"--{name.replace('_', '-')} {value}: expected {need}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed {args.seed}: expected an integer from 0 to {MAX_SEED}")
    dcfg = {name: getattr(args, name) for name in ("task", *lowest)}
    dcfg.update(train_samples=args.train, val_samples=args.val)
    problem = memory_problem(dcfg, f"--train {args.train} --val {args.val}")
    if problem:
        raise ConfigError(problem)


def _refuse_existing_output(path: Path, force: bool) -> None:
    """`data synth` writes over nothing it was not told to: OUT may be the user's real
    data set (checked before generating, so a refusal costs nothing)."""
    from .errors import DataError

    if path.is_dir():
        raise DataError(f"{path} is a directory: name the HDF5 file to write, e.g. {path}/data.h5")
    if not path.parent.is_dir():  # a typo made whole directory trees (/nonexist/dir/)
        raise DataError(
            f"{path}: no directory {path.parent}: create it first (data synth writes the "
            "file, not the directories above it)"
        )
    if os.path.lexists(path) and not force:
        raise DataError(
            f"{path} exists: pass --force to replace it (its data is lost), or name another file"
        )


COMMANDS = {
    "doctor": _cmd_doctor,
    "train": _cmd_train,
    "ps": _cmd_train,
    "config": _cmd_config,
    "data": _cmd_data,
}


def _first_on_its_node() -> bool:
    """Whether this process is its node's first rank as the launcher exported it (True
    alone, or when the launcher says nothing of local ranks: then rank 0), without MPI."""
    from .runtime.launcher import launcher_views

    try:
        views = launcher_views()
    except ValueError:
        return True
    if not views:
        return True
    values = views[0].values
    return values.get("local_rank", values.get("rank", 0)) == 0


def main(argv: list[str] | None = None) -> int:
    from .backends import tf_env  # noqa: F401 - TF's start-up noise off on every rank

    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)
    if UNLOADABLE and command not in (None, "doctor"):
        # Said once per node, by its first rank, before MPI: the install is a node's, and
        # a node that lacks a piece beside nodes that have it must still be named (at
        # 1,024 or 4,096 ranks, one line per broken node, none from the others).
        if _first_on_its_node():
            problem = "; ".join(f"{m} ({e})" for m, e in UNLOADABLE.items())
            print(
                f"hpctrain: the install on {platform.node()} is incomplete: cannot import "
                f"{problem}. `hpctrain doctor` checks every piece.",
                file=sys.stderr,
            )
        return 2  # on every rank (mpirun then ends the job)
    args, extra = parser.parse_known_args(argv)
    if extra:  # a YAML file given bare is the commonest slip: say where it goes
        yaml_file = next((w for w in extra if w.endswith((".yaml", ".yml"))), None)
        hint = f" (give a configuration file as --config {yaml_file})" if yaml_file else ""
        if yaml_file and getattr(args, "config", None):
            hint = f" (one configuration file, --config {args.config}; --set changes it)"
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    from .runtime import run_fail_together

    code = run_fail_together(COMMANDS[args.command], args)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
