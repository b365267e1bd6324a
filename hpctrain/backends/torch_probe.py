"""What `hpctrain doctor` asks the torch backend: versions, GPUs, Horovod build facts."""

from __future__ import annotations

import torch


def probe() -> dict:
    """Versions, GPUs and Horovod build facts, for `hpctrain doctor`."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "n/a"
    framework = (
        f"{torch.__version__} (threads {torch.get_num_threads()}, CUDA "
        f"{f'yes, {gpus} GPU(s), NCCL {nccl}' if gpus else 'no'})"
    )
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as exc:  # a GPU node's Python may run the nccl/mpi engines alone
        return {
            "framework": framework,
            "horovod": f"not installed ({exc}); engines nccl, gloo, mpi work without it",
            "missing": ["Horovod"],
        }
    built = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built()}
    missing = [k for k in ("MPI", "Gloo") if not built[k]]
    ops = ", ".join(k for k, v in built.items() if v) or "none"
    return {
        "framework": framework,
        "horovod": f"{horovod.__version__}; controllers/ops: {ops}"
        + ("" if built["NCCL"] or not gpus else " (no NCCL: train.allreduce=horovod stays on CPU)"),
        "missing": missing,
    }


def gpu_of_rank(index: int) -> str:
    """GPU `index` (among those this rank sees), as doctor's table shows the GPU a rank
    would use under runtime.device auto/cuda (runtime/devices.assign_gpus chose it)."""
    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} {props.name} {props.total_memory / 2**30:.0f} GiB"
