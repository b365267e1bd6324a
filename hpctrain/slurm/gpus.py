"""The GPU options of `hpctrain slurm render`, checked before the job queues.

hpctrain runs one rank per GPU (one SLURM task per GPU), so the options are checked
against that as well as against SLURM's own rules (sbatch(1), Slurm 22.05):

- `--gpus-per-node G` writes `--gres=gpu:G` (the form every select plugin reads); the
  job's steps get all of a node's GPUs and the node's ranks take one each. G above
  `--ntasks-per-node` leaves GPUs idle, G below it makes ranks share one: warnings,
  since a host-staged engine can share a GPU on purpose, but refused under
  `train.allreduce: nccl` (one GPU per rank: the job would stop at start).
- `--gpus-per-task N` writes `--gpus-per-task=N` and, as SLURM requires of it, an
  explicit `--ntasks`; srun gets it again. N > 1 leaves GPUs idle: a warning.
  `--gpus-per-node` and `--gpus-per-task` are two ways of asking for the same GPUs:
  given together they are refused.
- `--gpu-bind [verbose,]TYPE` (closest, none, map_gpu:L, mask_gpu:L, per_task:N,
  single:N) goes to sbatch and to srun; single:N above 1 shares each GPU among N ranks
  (a warning; refused under nccl, as above).
- `--cpus-per-gpu C` replaces `--cpus-per-task` (sbatch: "not compatible with the
  --cpus-per-task option"); srun gets `--cpus-per-gpu` instead of `--cpus-per-task`,
  and OMP_NUM_THREADS is C times the GPUs of one rank.

GPUs are useful only to an install that can drive them. What matters is how the
framework was built (CUDA or ROCm), not whether this login node has a GPU, so the build
is read from the framework's own files without importing it (`install_gpu_support`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..runtime.devices import gpu_unsupported

GPU_BIND_TYPES = ("closest", "none", "map_gpu:LIST", "mask_gpu:LIST", "per_task:N", "single:N")
_GPU_COUNT = re.compile(r"^(?:([A-Za-z0-9_.-]+):)?(\d+)$")
_GPU_LIST = re.compile(r"^(?:(?:0x)?[0-9A-Fa-f]+(?:\*\d+)?)(?:,(?:0x)?[0-9A-Fa-f]+(?:\*\d+)?)*$")


@dataclass(frozen=True)
class GpuCount:
    """`[type:]count` as sbatch takes it for --gpus-per-node and --gpus-per-task."""

    count: int
    type: str | None = None

    def __str__(self) -> str:
        return f"{self.type}:{self.count}" if self.type else str(self.count)


def gpu_count(option: str, value) -> GpuCount | None:
    """`value` ('4' or 'a100:4') as a GpuCount, None when not given; ConfigError if bad."""
    if value is None:
        return None
    text = str(value).strip()
    m = _GPU_COUNT.match(text)
    if not m or int(m.group(2)) < 1:
        raise ConfigError(
            f"{option} must be a positive integer, optionally after a GPU type "
            f"(e.g. 4 or a100:4), got {value!r}"
        )
    return GpuCount(int(m.group(2)), m.group(1))


def gpu_bind(value) -> str | None:
    """A `--gpu-bind` value sbatch and srun accept, or a ConfigError naming the forms."""
    if value is None:
        return None
    text = str(value).strip()
    kind = text[len("verbose,") :] if text.startswith("verbose,") else text
    name, _, arg = kind.partition(":")
    ok = (
        (name in ("closest", "none") and not arg)
        or (name in ("map_gpu", "mask_gpu") and bool(_GPU_LIST.match(arg)))
        or (name in ("per_task", "single") and arg.isdigit() and int(arg) >= 1)
    )
    if not ok:
        raise ConfigError(
            f"--gpu-bind {value!r}: expected [verbose,]TYPE with TYPE one of "
            f"{', '.join(GPU_BIND_TYPES)} (e.g. closest, single:1, map_gpu:0,1,2,3)"
        )
    return text


def _literal_assignments(path: Path) -> dict:
    """Top-level `name = literal` (and `name: T = literal`) of a Python file, unexecuted."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name):
            with contextlib.suppress(ValueError):
                values[target.id] = ast.literal_eval(value)
    return values


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)  # locates the package, imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def install_gpu_support(backend: str) -> tuple[bool, str]:
    """(whether this installation's `backend` was built to use GPUs, what was found).

    torch: `torch/version.py` (`cuda`, `hip`); TensorFlow:
    `tensorflow/python/platform/build_info.py` (`is_cuda_build`, `is_rocm_build`)."""
    if backend == "torch":
        where = _package_dir("torch")
        if where is None:
            return False, "torch is not installed"
        try:
            info = _literal_assignments(where / "version.py")
        except (OSError, SyntaxError) as exc:
            return False, f"torch's build could not be read ({where / 'version.py'}: {exc})"
        version = info.get("__version__", _version("torch"))
        if info.get("cuda"):
            return True, f"torch {version} is built with CUDA {info['cuda']}"
        if info.get("hip"):
            return True, f"torch {version} is built with ROCm (HIP {info['hip']})"
        return False, f"torch {version} is a CPU-only build (torch.version.cuda is None)"
    if backend == "tensorflow":
        where = _package_dir("tensorflow")
        if where is None:
            return False, "tensorflow is not installed"
        version = _version("tensorflow", "tensorflow-cpu")
        try:
            text = (where / "python" / "platform" / "build_info.py").read_text()
        except OSError as exc:
            return False, f"tensorflow's build could not be read ({exc.strerror or exc})"
        if re.search(r"'is_cuda_build',\s*True", text):
            return True, f"tensorflow {version} is built with CUDA"
        if re.search(r"'is_rocm_build',\s*True", text):
            return True, f"tensorflow {version} is built with ROCm"
        return False, f"tensorflow {version} is a CPU-only build (is_cuda_build is False)"
    return False, f"backend {backend!r} has no GPU support in hpctrain"


@dataclass
class GpuPlan:
    """The checked GPU options, and what they make of the script."""

    per_node: GpuCount | None
    per_task: GpuCount | None
    bind: str | None
    cpus_per_gpu: int | None
    ranks_per_node: int

    @property
    def asked(self) -> bool:
        return self.per_node is not None or self.per_task is not None

    @property
    def option(self) -> str:
        """The option that asked for GPUs, as given (for messages)."""
        if self.per_task is not None:
            return f"--gpus-per-task {self.per_task}"
        return f"--gpus-per-node {self.per_node}"

    @property
    def gpus_per_rank(self) -> int:
        if self.per_task is not None:
            return self.per_task.count
        if self.per_node is not None:
            return max(1, self.per_node.count // self.ranks_per_node)
        return 0

    def bind_type(self) -> tuple[str, str]:
        """--gpu-bind's type and argument ("single", "2"; ("", "") when not given)."""
        name, _, arg = (self.bind or "").removeprefix("verbose,").partition(":")
        return name, arg

    def srun_options(self) -> str | None:
        """GPU options srun gets again (explicit, as --cpus-per-task is)."""
        words = []
        if self.per_task is not None:
            words.append(f"--gpus-per-task={self.per_task}")
        if self.bind is not None:
            words.append(f"--gpu-bind={self.bind}")
        return " ".join(words) or None


def plan_gpus(
    per_node,
    per_task,
    bind,
    cpus_per_gpu,
    cpus_per_task_given: bool,
    ranks_per_node: int,
    warnings: list[str],
) -> GpuPlan:
    """Check the GPU options against SLURM's rules and one rank per GPU; ConfigError for
    what sbatch would reject or cannot mean, a warning for GPUs that would sit idle."""
    from .templates import positive_int

    plan = GpuPlan(
        gpu_count("--gpus-per-node", per_node),
        gpu_count("--gpus-per-task", per_task),
        gpu_bind(bind),
        None if cpus_per_gpu is None else positive_int("--cpus-per-gpu", cpus_per_gpu),
        ranks_per_node,
    )
    if plan.per_node is not None and plan.per_task is not None:
        raise ConfigError(
            f"--gpus-per-node {plan.per_node} and --gpus-per-task {plan.per_task} both ask "
            "for the GPUs: give one (one rank per GPU: --gpus-per-task 1, or --gpus-per-node "
            "equal to --ntasks-per-node)"
        )
    if not plan.asked:
        for option, value in (("--gpu-bind", plan.bind), ("--cpus-per-gpu", plan.cpus_per_gpu)):
            if value is not None:
                raise ConfigError(
                    f"{option} {value} needs GPUs: add --gpus-per-task 1 (one rank per GPU) "
                    "or --gpus-per-node G"
                )
        return plan
    if plan.cpus_per_gpu is not None and cpus_per_task_given:
        raise ConfigError(
            "--cpus-per-gpu and --cpus-per-task exclude each other (sbatch: not compatible): "
            "give one"
        )
    if plan.per_node is not None:
        g, t = plan.per_node.count, ranks_per_node
        if g < t:
            warnings.append(
                f"--gpus-per-node {plan.per_node} with --ntasks-per-node {t}: ranks would "
                "share GPUs; hpctrain runs one rank per GPU and refuses more ranks than GPUs "
                "at start unless the gradient engine stages through the host"
            )
        elif g > t:
            warnings.append(
                f"--gpus-per-node {plan.per_node} with --ntasks-per-node {t}: hpctrain runs "
                f"one rank per GPU, so {g - t} GPU(s) per node would sit idle"
            )
    if plan.per_task is not None and plan.per_task.count > 1:
        warnings.append(
            f"--gpus-per-task {plan.per_task}: each rank uses one GPU, so "
            f"{plan.per_task.count - 1} of every rank's {plan.per_task.count} would sit idle"
        )
    if plan.bind is not None:
        name, arg = plan.bind_type()
        if name == "single" and int(arg) > 1:
            warnings.append(
                f"--gpu-bind {plan.bind}: {arg} ranks would share each GPU; hpctrain runs one "
                "rank per GPU (single:1)"
            )
        if name == "per_task" and int(arg) > 1:
            warnings.append(f"--gpu-bind {plan.bind}: each rank would see {arg} GPUs and use one")
    return plan


def check_install(plan: GpuPlan, cfg, job_hpctrain: str | None, warnings: list) -> None:
    """Refuse GPUs that this config cannot use, whatever installation runs it, and GPUs
    that this install cannot drive; warn instead for the install where the job runs
    another installation (--hpctrain CMD), which cannot be inspected from here.

    Refused rather than warned: the job would hold (and be charged for) GPUs that its
    ranks never use, and at run time `runtime.device: auto` falls back to the CPU with
    no more than a log line. The build is what counts, not this login node's GPUs.
    """
    device = (cfg["runtime"] or {}).get("device")  # absent before GPU ranks existed
    if not plan.asked:
        if device == "cuda":
            warnings.append(
                "the config sets runtime.device: cuda but no GPU option was given: the job "
                "gets GPUs only where the partition gives them by default (add "
                "--gpus-per-task 1)"
            )
        return
    holds = f"{plan.option} asks for GPUs, but"
    idle = "the job would hold GPUs its ranks do not use"
    if device == "cpu":
        raise ConfigError(
            f"{holds} the config sets runtime.device: cpu: {idle}; set runtime.device to "
            "auto or cuda, or drop the GPU options"
        )
    why = gpu_unsupported(cfg)  # why this hpctrain keeps the ranks off the GPUs
    if why:
        fate = "would stop at start" if device == "cuda" else "would stay on CPUs"
        problem = f"{holds} the config's ranks {fate} ({why}): {idle}"
        # what waits for the GPU check may run in the job's installation or environment
        if job_hpctrain is None or gpu_unsupported(cfg, untested_ok=True):
            raise ConfigError(f"{problem}; change the config or drop the GPU options")
        warnings.append(f"{problem} (checked here; the job runs {job_hpctrain})")
    _refuse_shared_gpus_under_nccl(plan, cfg)
    usable, found = install_gpu_support(cfg["backend"])
    if usable:
        return
    problem = f"{holds} {found}: {idle}"
    if job_hpctrain is None:
        raise ConfigError(
            f"{problem}; install a GPU build of {cfg['backend']}, drop the GPU options, or "
            "name the installation the job runs with --hpctrain CMD (then this is only a "
            "warning)"
        )
    warnings.append(f"{problem} (checked here; the job runs {job_hpctrain})")


def _refuse_shared_gpus_under_nccl(plan: GpuPlan, cfg) -> None:
    """train.allreduce: nccl with ranks sharing GPUs is refused at start (runtime/
    devices.py, backends/torch_device.py: NCCL needs one GPU per rank): say so before
    the queue."""
    if cfg["train"]["allreduce"] != "nccl":
        return
    ranks, shared = plan.ranks_per_node, None
    if plan.per_node is not None and plan.per_node.count < ranks:
        shared = f"--gpus-per-node {plan.per_node} with --ntasks-per-node {ranks}"
    name, arg = plan.bind_type()
    if name == "single" and int(arg) > 1:
        shared = f"--gpu-bind {plan.bind} ({arg} ranks a GPU)"
    if shared:
        raise ConfigError(
            f"{shared} and train.allreduce: nccl: NCCL needs one GPU per rank, and the job "
            f"would stop at start; give one GPU per rank (--gpus-per-task 1, or "
            "--gpus-per-node equal to --ntasks-per-node), or let ranks share GPUs with "
            "train.allreduce mpi or auto"
        )
