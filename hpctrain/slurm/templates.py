"""Fill hpctrain's sbatch templates, after checking every value a job would trip over.

A mistyped time limit or config key found by `sbatch` costs a queue wait; found here it
costs nothing. Templates are plain bash with `{{name}}` placeholders:

- `{{name}}` is replaced by its value (already shell-quoted where it sits in a command);
  an unknown name is an error, so a typo in a custom template is caught at once.
- A line holding a placeholder whose optional value was not given (`gpus_per_node`,
  `gpus_per_task`, `gpu_bind`, `cpus_per_gpu`, `ntasks`, `cpus_per_task`, `partition`,
  `account`, `qos`, `mem`, `mem_per_cpu`, `constraint`, `exclusive`, `sbatch_lines`,
  `modules`, `srun_gpus`) is dropped, e.g. `#SBATCH --gres=gpu:{{gpus_per_node}}`
  without GPUs. `{{sbatch_lines}}` stands for the free `--sbatch-line` directives and
  `{{modules}}` for the `module load` lines of `--module`, one line each.
- `{{srun_cpus}}` is srun's CPU option (`--cpus-per-task="$SLURM_CPUS_PER_TASK"`, or
  `--cpus-per-gpu=...` with `--cpus-per-gpu`), `{{srun_gpus}}` its GPU options
  (`--gpus-per-task`, `--gpu-bind`), `{{omp_threads}}` the threads of one rank.
- `# hpctrain-template: strategy=NAME` makes the config's `strategy` mandatory and
  `# hpctrain-template: set=KEY=VALUE` adds an override the script itself passes, so
  that the config is validated exactly as the job will load it.

The canonical templates live in `hpctrain/slurm/templates/` (installed with the
package); the repository's `slurm/` directory links to them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .gpus import check_install, plan_gpus

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
SUFFIX = ".sbatch"
MPI_PLUGINS = ("pmix", "pmi2")  # Open MPI needs pmix; MPICH and Intel MPI want pmi2
SIGNAL_LEAD_S = 90  # the templates' --signal=USR1@90

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_META = re.compile(r"^#\s*hpctrain-template:\s*([\w-]+)=(\S+)\s*$", re.M)
# sbatch's --time formats (sbatch(1)), each field's name, in the order written.
TIME_FORMATS = {
    "minutes": re.compile(r"^(\d+)$"),
    "minutes:seconds": re.compile(r"^(\d+):(\d+)$"),
    "hours:minutes:seconds": re.compile(r"^(\d+):(\d+):(\d+)$"),
    "days-hours": re.compile(r"^(\d+)-(\d+)$"),
    "days-hours:minutes": re.compile(r"^(\d+)-(\d+):(\d+)$"),
    "days-hours:minutes:seconds": re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"),
}
_UNIT_S = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
_UNIT_LIMIT = {"hours": 24, "minutes": 60, "seconds": 60}  # when not the first field
_NO_LIMIT = ("0", "-1", "infinite", "unlimited")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
_MEMORY = re.compile(r"^(\d+)([KMGTkmgt])?$")
_MODULE = re.compile(r"^[A-Za-z0-9_.+/@:=~-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.:*&|,\[\]()!-]+$")
# Directives the template writes itself: an --sbatch-line must not set them twice.
MANAGED = {
    "--job-name": "--job-name",
    "--nodes": "--nodes",
    "--ntasks-per-node": "--ntasks-per-node",
    "--ntasks": "--nodes and --ntasks-per-node",
    "--cpus-per-task": "--cpus-per-task",
    "--time": "--time",
    "--partition": "--partition",
    "--gres": "--gpus-per-node",
    "--gpus": "--gpus-per-node or --gpus-per-task",
    "--gpus-per-node": "--gpus-per-node",
    "--gpus-per-task": "--gpus-per-task",
    "--gpu-bind": "--gpu-bind",
    "--cpus-per-gpu": "--cpus-per-gpu",
    "--account": "--account",
    "--qos": "--qos",
    "--mem": "--mem",
    "--mem-per-cpu": "--mem-per-cpu",
    "--constraint": "--constraint",
    "--exclusive": "--exclusive",
    "--output": "--log-dir",
    "--error": "--log-dir",
    "--signal": "nothing (hpctrain checkpoints on SIGUSR1 90 s before the limit)",
    "--requeue": "nothing (the templates requeue)",
    "--array": "nothing (the sweep template sets it)",
}


def template_names() -> list[str]:
    """The templates shipped with hpctrain, by name (`train`, `ps`, ...)."""
    return sorted(p.name[: -len(SUFFIX)] for p in TEMPLATE_DIR.glob(f"*{SUFFIX}"))


def find_template(name_or_path: str) -> Path:
    """A shipped template by name (`train`, `train.sbatch`) or any file by path."""
    stem = name_or_path[: -len(SUFFIX)] if name_or_path.endswith(SUFFIX) else name_or_path
    if "/" not in name_or_path and (TEMPLATE_DIR / f"{stem}{SUFFIX}").is_file():
        return TEMPLATE_DIR / f"{stem}{SUFFIX}"
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise ConfigError(
        f"template {name_or_path!r}: not a file and not one of {', '.join(template_names())}"
    )


def positive_int(option: str, value) -> int:
    """`value` as an integer >= 1, or a ConfigError naming the option."""
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1 or str(value).strip().lstrip("+") != str(number):
        raise ConfigError(f"{option} must be a positive integer, got {value!r}")
    return number


def parse_time(value: str) -> int:
    """A SLURM time limit in seconds, in any format sbatch accepts ("minutes",
    "minutes:seconds", "hours:minutes:seconds", "days-hours", "days-hours:minutes",
    "days-hours:minutes:seconds"); every field after the first within its unit."""
    text = str(value).strip()
    if text.lower() in _NO_LIMIT:
        raise ConfigError(
            f"--time {value!r} asks SLURM for no time limit: give the limit the job needs, "
            "greater than zero (hpctrain checkpoints and requeues 90 s before it; "
            "`sinfo -o '%P %l'` shows each partition's)"
        )
    for form, pattern in TIME_FORMATS.items():
        m = pattern.match(text)
        if not m:
            continue
        units = form.replace("-", ":").split(":")
        fields = [int(g) for g in m.groups()]
        for i, (unit, number) in enumerate(zip(units, fields, strict=True)):
            if i and number >= _UNIT_LIMIT[unit]:
                raise ConfigError(
                    f"--time {value!r}: {number} {unit} in {form} must be below "
                    f"{_UNIT_LIMIT[unit]} (only the first field may be larger)"
                )
        seconds = sum(_UNIT_S[unit] * n for unit, n in zip(units, fields, strict=True))
        if seconds <= 0:
            break
        return seconds
    raise ConfigError(
        f"--time {value!r}: expected one of sbatch's formats, greater than zero: minutes, "
        "minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes or "
        "days-hours:minutes:seconds (e.g. 90, 90:00, 02:00:00, 1-12)"
    )


def describe_seconds(seconds: int) -> str:
    """3725 -> '1 h 2 min 5 s' (SLURM rounds seconds up to the next minute)."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size} {unit}")
            seconds %= size
    return " ".join(parts)


def memory_size(option: str, value: str | None) -> str | None:
    """A memory size with its unit (K, M, G or T; `--mem 0`: all of the node's memory),
    or a ConfigError: sbatch reads a bare number as megabytes, which `--mem 64` rarely
    means."""
    if value is None:
        return None
    text = str(value).strip()
    m = _MEMORY.match(text)
    zero_ok = option == "--mem"
    if not m:
        raise ConfigError(
            f"{option} {value!r}: expected a size like 64G, 4000M or 512K (units K, M, G, T)"
            + (", or 0 for all of a node's memory" if zero_ok else "")
        )
    number, unit = m.groups()
    if int(number) == 0:
        if zero_ok and unit is None:
            return "0"
        raise ConfigError(
            f"{option} {value!r}: must be greater than zero"
            + (" (--mem 0, without a unit, asks for all of a node's memory)" if zero_ok else "")
        )
    if unit is None:
        raise ConfigError(
            f"{option} {value!r} has no unit, and sbatch would read it as {number} megabytes: "
            f"write {number}G for gigabytes (or {number}M if megabytes are meant)"
        )
    return f"{int(number)}{unit.upper()}"


def module_lines(names: list[str]) -> str | None:
    """`--module` names as the script's `module load` lines (None without any)."""
    if not names:
        return None
    for name in names:
        if not _MODULE.match(str(name).strip()):
            raise ConfigError(
                f"--module {name!r}: expected one module name like openmpi/4.1.5 or cuda/12.2 "
                "(repeat --module for each)"
            )
    lines = [
        "if ! type module >/dev/null 2>&1; then",
        "    echo \"hpctrain job: this batch shell has no 'module' command (Lmod or "
        'Environment Modules): submit from a shell where it works (sbatch passes it on)" >&2',
        "    exit 1",
        "fi",
        "set +u  # module scripts may read unset variables",
        *(f"module load {shlex.quote(str(name).strip())}" for name in names),
        "set -u",
    ]
    return "\n".join(lines)


def sweep_points(nodes: int, ntasks_per_node: int) -> list[tuple[int, int]]:
    """(nodes, ranks) points of a scaling sweep: 1, 2, 4... ranks on one node, then
    1, 2, 4... full nodes, always ending with the whole allocation."""
    points = []
    r = 1
    while r < ntasks_per_node:
        points.append((1, r))
        r *= 2
    n = 1
    while n < nodes:
        points.append((n, n * ntasks_per_node))
        n *= 2
    points.append((nodes, nodes * ntasks_per_node))
    return sorted(set(points), key=lambda p: (p[1], p[0]))


def template_meta(text: str) -> dict[str, list[str]]:
    """`# hpctrain-template: key=value` lines of a template, as {key: [values]}."""
    meta: dict[str, list[str]] = {}
    for key, value in _META.findall(text):
        meta.setdefault(key, []).append(value)
    return meta


def fill(text: str, values: dict[str, str | None], source: str = "template") -> str:
    """Replace `{{name}}`; drop lines whose placeholders include an unset (None) value."""
    out = []
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        names = _PLACEHOLDER.findall(line)
        unknown = sorted(set(names) - set(values))
        if unknown:
            raise ConfigError(
                f"{source}:{lineno}: unknown placeholder {{{{{unknown[0]}}}}} "
                f"(known: {', '.join(sorted(values))})"
            )
        if any(values[n] is None for n in names):
            continue
        out.append(_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), line))
    return "".join(out)


def default_hpctrain() -> str:
    """The hpctrain command of this installation, so the job runs the same one."""
    beside = Path(sys.executable).parent / "hpctrain"
    if beside.is_file():
        return str(beside)
    return shutil.which("hpctrain") or "hpctrain"


@dataclass
class JobSpec:
    """What `hpctrain slurm render` was asked for, as given on the command line."""

    template: str
    nodes: str | int
    ntasks_per_node: str | int
    time: str
    config: str
    cpus_per_task: str | int | None = None  # 1 unless cpus_per_gpu is given
    gpus_per_node: str | int | None = None
    gpus_per_task: str | int | None = None
    gpu_bind: str | None = None
    cpus_per_gpu: str | int | None = None
    partition: str | None = None
    mpi: str = "pmix"
    overrides: list[str] = field(default_factory=list)
    job_name: str | None = None
    log_dir: str = "."
    run_root: str = "runs"
    results_dir: str = "benchmarks/results"
    hpctrain: str | None = None
    command: str = "hpctrain slurm render"
    account: str | None = None
    qos: str | None = None
    mem: str | None = None
    mem_per_cpu: str | None = None
    exclusive: bool = False
    constraint: str | None = None
    sbatch_lines: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)


@dataclass
class Rendered:
    """A filled template, with the notes worth telling the user."""

    text: str
    template: Path
    job_name: str
    warnings: list[str] = field(default_factory=list)
    seconds: int = 0  # the time limit, as SLURM reads --time


def _check_config(spec: JobSpec, meta: dict[str, list[str]], template: str):
    """(resolved config path, loaded Config); ConfigError when the template cannot run it."""
    from ..config import Config
    from ..models.zoo import has_moe

    path = Path(spec.config).expanduser()
    if not path.is_file():
        raise ConfigError(f"--config {spec.config}: no such file")
    cfg = Config.load(path, list(spec.overrides) + meta.get("set", []))
    for wanted in meta.get("strategy", []):
        if cfg["strategy"] != wanted:
            raise ConfigError(
                f"template {template} runs strategy {wanted!r} but the config has "
                f"strategy {cfg['strategy']!r} (set `strategy: {wanted}` in {path})"
            )
    if "checkpoints" in meta.get("needs", []) and not cfg.checkpoint["enabled"]:
        raise ConfigError(
            f"template {template} restarts from checkpoints, but the config has "
            "checkpoint.enabled false (set it true, or use the train template)"
        )
    if "moe" in meta.get("needs", []) and not has_moe(cfg.model):
        raise ConfigError(
            f"template {template} trains mixture-of-experts models, but the config's model "
            f"{cfg.model['name']} has no model.moe: use the train template, or set model.moe "
            "in a transformer config"
        )
    return path.resolve(), cfg


def _check_world_size(cfg, nodes: int, per_node: int, sweep: list | None) -> None:
    """ConfigError when the ranks asked for (each sweep point's, for sweeps) do not fit."""
    from .fit import training_split, world_size_problems

    if sweep is None:
        asked = [(nodes * per_node, f"--nodes {nodes} x --ntasks-per-node {per_node}")]
    else:
        asked = [
            (r, f"sweep point {i} ({r} rank(s) on {n} node(s))") for i, (n, r) in enumerate(sweep)
        ]
    split = training_split(cfg)  # once: an HDF5 file's metadata
    problems = [p for r, where in asked for p in world_size_problems(cfg, r, where, split)]
    if problems:
        raise ConfigError("; ".join(problems))


def _optional(option: str, value: str | None, pattern: re.Pattern, example: str) -> str | None:
    if value is None:
        return None
    value = str(value).strip()
    if not pattern.match(value):
        raise ConfigError(f"{option} {value!r}: expected {example}")
    return value


def sbatch_directives(lines: list[str]) -> str | None:
    """`--sbatch-line` values as `#SBATCH ...` lines; refuses ones the template sets."""
    out = []
    for raw in lines:
        text = raw.strip()
        if text.startswith("#SBATCH"):
            text = text[len("#SBATCH") :].strip()
        if not text.startswith("-") or "\n" in raw or not text:
            raise ConfigError(
                f"--sbatch-line {raw!r}: expected one sbatch option, e.g. "
                "--sbatch-line=--mail-type=END"
            )
        option = text.split("=", 1)[0].split()[0]
        long = {
            "-A": "--account",
            "-N": "--nodes",
            "-t": "--time",
            "-p": "--partition",
            "-J": "--job-name",
            "-o": "--output",
            "-e": "--error",
            "-c": "--cpus-per-task",
            "-n": "--ntasks",
            "-G": "--gpus",
            "-C": "--constraint",
            "-q": "--qos",
            "-a": "--array",
        }.get(option, option)
        if long in MANAGED:
            raise ConfigError(
                f"--sbatch-line {raw!r}: the template sets {long} itself; use "
                f"{MANAGED[long]} instead"
            )
        out.append(f"#SBATCH {text}")
    return "\n".join(out) if out else None


def render(spec: JobSpec) -> Rendered:
    """Validate every value of `spec`, then fill its template. Raises ConfigError."""
    template = find_template(spec.template)
    try:
        text = template.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"template {template}: not a text file (not UTF-8)") from None
    warnings: list[str] = []
    nodes = positive_int("--nodes", spec.nodes)
    per_node = positive_int("--ntasks-per-node", spec.ntasks_per_node)
    cpus = (
        None if spec.cpus_per_task is None else positive_int("--cpus-per-task", spec.cpus_per_task)
    )
    gpus = plan_gpus(
        spec.gpus_per_node,
        spec.gpus_per_task,
        spec.gpu_bind,
        spec.cpus_per_gpu,
        cpus is not None,
        per_node,
        warnings,
    )
    if gpus.cpus_per_gpu is None and cpus is None:
        cpus = 1
    seconds = parse_time(spec.time)
    site = _site_values(spec, template)
    meta = template_meta(text)
    config, cfg = _check_config(spec, meta, template.name)
    points = sweep_points(nodes, per_node)
    _check_world_size(cfg, nodes, per_node, points if "sweep" in meta.get("needs", []) else None)
    check_install(gpus, cfg, spec.hpctrain, warnings)
    config_args = ["--config", str(config)]
    for override in spec.overrides:
        config_args += ["--set", override]
    values: dict[str, str | None] = {
        "generated": f"rendered by: {spec.command}",
        **site,
        **_resource_values(nodes, per_node, cpus, gpus),
        "run_root": shlex.quote(spec.run_root),
        "results_dir": shlex.quote(spec.results_dir),
        "hpctrain": shlex.quote(spec.hpctrain or default_hpctrain()),
        "config_args": shlex.join(config_args),
        "sweep_nodes": " ".join(str(n) for n, _ in points),
        "sweep_ranks": " ".join(str(r) for _, r in points),
        "sweep_last": str(len(points) - 1),
    }
    if seconds <= SIGNAL_LEAD_S:
        warnings.append(
            f"--time {spec.time} is not longer than the {SIGNAL_LEAD_S} s warning "
            "(--signal=USR1@90): the job is told to checkpoint and requeue as it starts"
        )
    job_name = site["job_name"]
    return Rendered(fill(text, values, str(template)), template, job_name, warnings, seconds)


def _site_values(spec: JobSpec, template: Path) -> dict[str, str | None]:
    """The template's site and naming placeholders, each value checked first."""
    if spec.mpi not in MPI_PLUGINS:
        raise ConfigError(
            f"--mpi {spec.mpi!r}: expected pmix (Open MPI) or pmi2 (MPICH, Intel MPI)"
        )
    if spec.partition is not None and not _PARTITION.match(spec.partition):
        raise ConfigError(f"--partition {spec.partition!r}: expected a name like 'gpu' or 'a,b'")
    stem = template.name[: -len(SUFFIX)] if template.name.endswith(SUFFIX) else template.stem
    job_name = spec.job_name or f"hpctrain-{stem}"
    if not _NAME.match(job_name):
        raise ConfigError(f"--job-name {job_name!r}: use letters, digits and _.+- only")
    if not spec.log_dir or re.search(r"[\s%]", spec.log_dir):
        raise ConfigError(f"--log-dir {spec.log_dir!r}: must be non-empty, without spaces or %")
    account = _optional("--account", spec.account, _NAME, "an account name like 'proj123'")
    qos = _optional("--qos", spec.qos, _NAME, "a QOS name like 'normal'")
    mem = memory_size("--mem", spec.mem)
    mem_per_cpu = memory_size("--mem-per-cpu", spec.mem_per_cpu)
    if mem is not None and mem_per_cpu is not None:
        raise ConfigError("--mem and --mem-per-cpu exclude each other (sbatch takes one)")
    constraint = _optional(
        "--constraint", spec.constraint, _CONSTRAINT, "node features like 'haswell' or 'a100&ib'"
    )
    return {
        "job_name": job_name,
        "partition": spec.partition,
        "account": account,
        "qos": qos,
        "mem": mem,
        "mem_per_cpu": mem_per_cpu,
        "constraint": constraint,
        "exclusive": "" if spec.exclusive else None,
        "sbatch_lines": sbatch_directives(spec.sbatch_lines),
        "modules": module_lines(spec.modules),
        "time": spec.time.strip(),
        "mpi": spec.mpi,
        "log_dir": spec.log_dir.rstrip("/") or "/",
    }


def _resource_values(nodes: int, per_node: int, cpus: int | None, gpus) -> dict[str, str | None]:
    """The allocation's placeholders: tasks, CPUs and GPUs for sbatch and srun."""
    if gpus.cpus_per_gpu is None:
        srun_cpus = '--cpus-per-task="$SLURM_CPUS_PER_TASK"'
        omp_threads = "${SLURM_CPUS_PER_TASK:-1}"
    else:  # sbatch and srun: --cpus-per-gpu is not compatible with --cpus-per-task
        srun_cpus = '--cpus-per-gpu="$SLURM_CPUS_PER_GPU"'
        omp_threads = f"$((${{SLURM_CPUS_PER_GPU:-{gpus.cpus_per_gpu}}} * {gpus.gpus_per_rank}))"
    return {
        "nodes": str(nodes),
        "ntasks_per_node": str(per_node),
        # --gpus-per-task needs an explicit task count (sbatch(1))
        "ntasks": None if gpus.per_task is None else str(nodes * per_node),
        "cpus_per_task": None if cpus is None else str(cpus),
        "gpus_per_node": None if gpus.per_node is None else str(gpus.per_node),
        "gpus_per_task": None if gpus.per_task is None else str(gpus.per_task),
        "gpu_bind": gpus.bind,
        "cpus_per_gpu": None if gpus.cpus_per_gpu is None else str(gpus.cpus_per_gpu),
        "srun_cpus": srun_cpus,
        "srun_gpus": gpus.srun_options(),
        "omp_threads": omp_threads,
    }
