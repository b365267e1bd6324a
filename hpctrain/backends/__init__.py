"""Framework backends. Only modules in this package import torch, TensorFlow or Horovod.

`load_backend(name)` imports one lazily, so a torch run never pays for TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.util
import socket
import sys

from ..errors import ConfigError

BACKENDS = ("torch", "tensorflow")


def framework_problem(name: str, what: str = "backend") -> str | None:
    """Why framework `name` cannot be used on this node (not installed), else None.

    Finds the package without importing it (milliseconds): the loop asks before any
    work, so a torch-only install given `backend: tensorflow` is one line on every rank
    instead of a ModuleNotFoundError traceback after the data was made."""
    if importlib.util.find_spec(name) is not None:
        return None
    return (
        f"{what} {name}: {name} is not installed for {sys.executable} on "
        f"{socket.gethostname()}: install it (`make install` installs both frameworks, "
        f"or pip install 'hpctrain[{name}]'){', or choose the other backend' if what == 'backend' else ''}"
    )


def require_framework(name: str, what: str = "backend") -> None:
    """ConfigError where `framework_problem` finds one."""
    problem = framework_problem(name, what)
    if problem is not None:
        raise ConfigError(problem)


def load_backend(name: str):
    """The backend module for `name` ('torch' or 'tensorflow'); ConfigError when its
    framework is not installed."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    require_framework(name)
    return importlib.import_module(f"hpctrain.backends.{name}")


def backend_class(name: str):
    """The data-parallel backend class (`TorchBackend` / `TensorFlowBackend`)."""
    module = load_backend(name)
    return module.TorchBackend if name == "torch" else module.TensorFlowBackend


def stage_module(name: str):
    """The pipeline-stage module of a framework (`torch_stage` / `tensorflow_stage`)."""
    load_backend(name)  # validates the name
    return importlib.import_module(f"hpctrain.backends.{name}_stage")


def stage_class(name: str):
    module = stage_module(name)
    return module.TorchStage if name == "torch" else module.TensorFlowStage


def worker_class(name: str):
    """The parameter-server worker class of a framework."""
    load_backend(name)
    module = importlib.import_module(f"hpctrain.backends.{name}_worker")
    return module.TorchWorker if name == "torch" else module.TensorFlowWorker


def versions(name: str) -> dict[str, str]:
    """Framework and Horovod versions recorded in checkpoints."""
    framework = importlib.import_module(name)
    try:
        import horovod

        hvd = horovod.__version__
    except ImportError:  # a GPU node's Python without Horovod (the nccl/mpi engines)
        hvd = "not installed"
    return {"framework": f"{name} {framework.__version__}", "horovod": hvd}


def plan_before_build(cfg, inp, groups, n: int, threads: int, rank: int, gpu: bool = False):
    """The memory plan of a data-parallel rank before its model exists: (terms,
    baseline bytes), or None where the backend cannot plan it without building it (the
    TensorFlow backend, a user's model): then the check runs after the build."""
    if cfg.backend != "torch":
        return None
    from .torch_plan import plan_before_build as torch_plan

    return torch_plan(cfg, inp, groups, n, threads, rank, gpu)


def plan_stage_before_build(cfg, inp, layers, start: int, local, groups, replicas: int,
                            in_flight: int, threads: int, rank: int, gpu: bool = False):  # fmt: skip
    """The memory plan of a pipeline stage's rank before the stage exists: (terms,
    baseline bytes), or None where it cannot be planned without building it (the
    TensorFlow backend, a user's model, experts): then it is not checked."""
    if cfg.backend != "torch":
        return None
    from .torch_plan import plan_pipeline_stage

    return plan_pipeline_stage(
        cfg, inp, layers, start, local, groups, replicas, in_flight, threads, rank, gpu
    )


def gpu_memory_budget(cfg, world):
    """(bytes, what) of GPU memory this rank may use before its model is built, None
    on CPU ranks and for other backends (torch_device.gpu_memory_budget; collective
    over the node for torch jobs that may use GPUs)."""
    if cfg.backend != "torch":
        return None
    from .torch_device import gpu_memory_budget as torch_budget

    return torch_budget(cfg, world)


def process_group_links(cfg, engine: str, grid, axes, device=None) -> dict:
    """{axis: transport} of the process-group engine over `grid`'s `axes`, for the
    strategies that place their own links (the pipeline: its stages compute on `device`,
    a GPU or the CPU; the config keeps these engines off TensorFlow)."""
    import torch

    from .torch_transport import grid_transports

    return grid_transports(cfg, engine, device or torch.device("cpu"), grid, axes)


def stage_device(cfg, world):
    """(device, why, ranks share a GPU) of a pipeline stage: torch's agreed device
    (torch_device.agreed_device, collective), None for TensorFlow's (CPU) stages."""
    if cfg.backend != "torch":
        return None, "CPU ranks", False
    from .torch_device import agreed_device

    return agreed_device(cfg, world)
