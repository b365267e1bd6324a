"""Where a torch rank computes, and how batches and state cross to and from it.

One code path for CPU and GPU ranks: on a CPU rank every function here is the identity
or a zero-copy view (the CPU suite runs exactly what it ran before); on a GPU rank
batches travel numpy -> reused pinned host slot -> device on a copy stream, state
comes back to the host as copies, and memory figures come from the CUDA allocator.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import ConfigError, HpctrainError
from ..runtime.devices import (
    GPU_UNTESTED,
    DeviceChoice,
    choose_device,
    gpu_unsupported,
    gpu_untested,
    offload_on_cpu,
)


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu_ids() -> list[str]:
    """The ids of the GPUs this process sees, in CUDA ordinal order ([] where CUDA
    cannot be asked: the device choice then says why)."""
    try:
        return [gpu_identity(torch.device("cuda", i)) for i in range(visible_gpus())]
    except (RuntimeError, AssertionError):
        return []


def resolve_device(cfg, layout, node=None) -> tuple[torch.device, DeviceChoice]:
    """This rank's torch device (and why), made current for CUDA.

    layout: the World's Layout (node-local rank and size, hostname); None for a process
    outside an MPI job. node: the node's communicator; where given, collective over it
    (every rank of the node calls this): the ranks share which GPUs each sees and take
    one each (runtime/devices.assign_gpus). Refusals are ConfigErrors, raised after that
    exchange and before the model is built.
    """
    local_rank = layout.local_rank if layout is not None else 0
    local_size = layout.local_size if layout is not None else 1
    host = layout.hostname if layout is not None else "this node"
    seen, gpus = None, visible_gpus()
    if node is not None and node.size > 1 and cfg.runtime["device"] != "cpu":
        seen = node.allgather_object(visible_gpu_ids(), what="share the GPUs each rank sees")
        local_rank = node.rank  # its place in `seen`
        if gpus > 1 and not seen[local_rank]:
            raise ConfigError(
                f"runtime.device: a rank on {host} sees {gpus} GPUs but CUDA could "
                "not name them (torch.cuda.get_device_properties failed): check the "
                "driver, or give each rank one GPU (--gpus-per-task 1)"
            )
    choice = choose_device(
        cfg.runtime["device"],
        gpus,
        local_rank,
        local_size,
        host,
        cfg.train["allreduce"],
        gpu_unsupported(cfg),
        node_gpus=seen,
    )
    if choice.kind == "cpu":
        return torch.device("cpu"), choice
    device = torch.device("cuda", choice.index)
    torch.cuda.set_device(device)
    untested = gpu_untested(cfg)
    if untested:  # only started with GPU_UNTESTED=1 (gpu_unsupported): say so
        choice = DeviceChoice(
            choice.kind,
            choice.index,
            f"{choice.reason}; {', '.join(untested)} not yet run across ranks on a GPU "
            f"({GPU_UNTESTED}=1)",
        )
    return device, choice


def offload_refusal(cfg, why: str) -> str:
    """CPU ranks have nothing to offload: runtime.device=auto kept them on the CPU (no
    usable GPU, or a layout GPU ranks do not run yet, said in `why`); runtime.device=cpu
    was refused by the config check already."""
    return f"{offload_on_cpu(cfg.train['offload'])}; these are CPU ranks ({why})"


def agreed_device(cfg, world):
    """(device, why, ranks share a GPU): one rank per GPU, taken among the GPUs each
    rank of the node sees (runtime/devices.assign_gpus); every rank agrees on errors (a
    node without GPUs, too many ranks for its GPUs).

    Cost, once at start-up: one allgather of visible GPU ids within each node (its size
    grows with the ranks per node only), one agreement (an allreduce of a flag) and one
    allgather of (device kind, host, GPU id), ~100 bytes a rank: 0.1 MB received per
    rank at 1,024 ranks, 0.4 MB at 4,096."""
    from ..runtime import world_if_started

    top = world_if_started()
    layout = getattr(top, "layout", None)
    error, device, why, shared = None, torch.device("cpu"), "", False
    try:
        # the node's ranks (the World's, whatever axis `world` is): every rank of a
        # torch job calls this, so the node's exchange of visible GPUs is complete
        device, choice = resolve_device(cfg, layout, node=getattr(top, "node", None))
        why = choice.reason
    except HpctrainError as exc:
        error = str(exc)
    if error is None and device.type != "cuda" and cfg.train["allreduce"] == "nccl":
        # said here with auto's reason: the engine's own refusal could not say why
        error = f"train.allreduce=nccl needs GPU ranks, and these are CPU ranks ({why})"
    elif error is None and device.type != "cuda" and cfg.train["offload"] != "none":
        error = offload_refusal(cfg, why)
    # over the whole job, whatever axis `world` is (a tensor-parallel job's replicas):
    # every rank builds its backend, and two tensor peers on one GPU are caught too
    everyone = top if world is not None and top is not None else world
    if everyone is not None and everyone.size > 1:
        everyone.agree(error, error_type=ConfigError)
        gpu = gpu_identity(device) if device.type == "cuda" else ""
        host = layout.hostname if layout is not None else ""
        ids = everyone.allgather_object((device.type, host, gpu), what="agree on devices")
        if len({kind for kind, _, _ in ids}) > 1:  # the same list on every rank
            raise ConfigError(
                "ranks disagree on the device (some see a GPU, some do not): set "
                "runtime.device to cpu or cuda"
            )
        shared = device.type == "cuda" and len(set(ids)) < len(ids)
    elif error is not None:
        raise ConfigError(error)
    if device.type == "cuda":
        prepare_cuda(cfg.train["deterministic"])
        torch.cuda.reset_peak_memory_stats(device)
    if shared and cfg.train["allreduce"] == "nccl":
        raise ConfigError(
            f"train.allreduce={cfg.train['allreduce']}: ranks share a GPU on "
            f"{layout.hostname if layout else 'this node'}; NCCL needs one GPU per rank "
            "(fewer ranks per node, or train.allreduce=mpi or gloo to stage through host "
            "memory)"
        )
    return device, why, shared


def gpu_memory_budget(cfg, world) -> tuple[int, str] | None:
    """(bytes, what they are) of GPU memory this rank may plan for before its model
    exists: what is free on the GPU it will use, divided among the node's ranks that
    share that GPU. None on CPU ranks, and where the device choice or a CUDA query fails
    (the backend's `agreed_device` then refuses with the reason, agreed by every rank).

    Collective over the node (every rank of a torch job with runtime.device other than
    cpu calls it): one allgather of a GPU id, ~50 bytes a rank; its cost grows with the
    ranks per node, never with the job, so it is the same at 4,096 ranks as at 4."""
    if cfg.runtime["device"] == "cpu":
        return None
    gpu, free, device = None, 0, None
    try:  # every CUDA call before the allgather: a failing rank still joins it
        node = getattr(world, "node", None)
        device, _ = resolve_device(cfg, getattr(world, "layout", None), node=node)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            gpu = gpu_identity(device)
    except (HpctrainError, RuntimeError):
        gpu = None  # no GPU check here; agreed_device refuses with the reason
    node = getattr(world, "node", None)
    ids = node.allgather_object(gpu, what="count the ranks per GPU") if node else [gpu]
    if gpu is None:
        return None
    sharing = ids.count(gpu)
    shared = f", shared by {sharing} ranks" if sharing > 1 else ""
    what = (
        f"{free // sharing / 2**20:,.0f} MiB free for this rank on {device} "
        f"({describe_gpu(device)}{shared})"
    )
    return free // sharing, what


def prepare_cuda(deterministic: bool) -> None:
    """cuBLAS needs a fixed workspace for deterministic kernels (torch refuses without)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def gpu_identity(device: torch.device) -> str:
    """A string naming this physical GPU (its UUID where torch has it)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}:{props.pci_bus_id}"


def describe_gpu(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"


def to_host(tensor: torch.Tensor, copy: bool = True) -> np.ndarray:
    """A numpy array of `tensor`: a view on CPU when copy=False, always a copy from a GPU
    (one that owns its memory: see `owned_copy`)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        return owned_copy(t)
    return t.numpy().copy() if copy else t.numpy()


def owned_copy(tensor: torch.Tensor) -> np.ndarray:
    """`tensor` copied once into an array that owns its memory. Why: an async checkpoint
    copies again, in the background, every array that does not own its memory (a view
    the trainer may still change: checkpoint/writer.py), and the next update waits for
    that copy; `.cpu().numpy()`, whose memory a torch tensor owns, looked like such a
    view, so a GPU rank's state was copied twice and the update waited for the second."""
    out = np.empty(tuple(tensor.shape), dtype=np.dtype(str(tensor.dtype).removeprefix("torch.")))
    torch.from_numpy(out).copy_(tensor.detach())
    return out


def from_host(array, like: torch.Tensor) -> torch.Tensor:
    """`array` (numpy) as float32 on `like`'s device."""
    return torch.from_numpy(np.array(array, dtype=np.float32)).to(like.device)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device` without the host waiting: on the CPU the same memory; on a GPU
    through a pinned copy sent with non_blocking (torch's pinned allocator keeps that
    block until the copy has run). A pageable copy would be the step's host wait: the
    driver returns only once the GPU has taken the bytes, behind the queued kernels.
    For a step's small host-made arrays (MoE routing plans, random-k's indices); batches
    go through DeviceFeeder's reused slots."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class DeviceFeeder:
    """Batches onto the rank's device without a host synchronisation.

    CPU: zero-copy tensors over the numpy arrays. CUDA: each array is copied into a
    reused pinned host slot (a ring of `depth` slot sets, so the slot written now was
    last read `depth` batches ago), then to the device with `non_blocking=True` on a
    copy stream; the compute stream waits for it where `put` is called, i.e. after the
    work queued so far. The host runs ahead of the GPU (nothing in the step
    synchronises), so a batch put while the current step is queued is copied during
    that step's compute.
    """

    def __init__(self, device: torch.device, depth: int = 3):
        self.device = device
        self.cuda = device.type == "cuda"
        self.depth = depth
        self._ring: dict[tuple, list] = {}
        self._turn: dict[tuple, int] = {}
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def put(self, array: np.ndarray) -> torch.Tensor:
        if not self.cuda:
            return torch.from_numpy(array)
        key = (array.shape, array.dtype.str)
        ring = self._ring.setdefault(key, [None] * self.depth)
        turn = self._turn.get(key, 0)
        self._turn[key] = (turn + 1) % self.depth
        slot = ring[turn]
        if slot is None:
            pinned = torch.empty(
                array.shape, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype
            )
            slot = ring[turn] = [pinned.pin_memory(), None]
        elif slot[1] is not None and not slot[1].query():
            # The copy out of this slot was issued `depth` batches ago: in a steady state
            # it is long done and nothing waits; only a host far ahead of the GPU does.
            slot[1].synchronize()
        slot[0].copy_(torch.from_numpy(array))  # a host copy into the slot: no read
        with torch.cuda.stream(self.stream):
            out = slot[0].to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        slot[1] = done
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        out.record_stream(main)
        return out


class HostValue:
    """One of a step's 0-d device sums, copied into pinned host memory behind the
    step's work. Reading it (float/int) waits for that copy only, through a CUDA event
    recorded after it; `.item()` on the device tensor would wait for the whole stream,
    the next step's queued work included, and leave the GPU idle while the host queues
    the step after (measured on an H100, 135 M transformer: 1.8 ms of a 40 ms step)."""

    def __init__(self, host: torch.Tensor, index: int, done):
        self._host, self._index, self._done = host, index, done

    def _read(self):
        self._done.synchronize()
        return self._host[self._index].item()  # a host tensor: no device synchronisation

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())


def read_later(stats):
    """A GPU step's stats with its device sums as HostValues; a CPU step's read now (the
    same step, so a CPU test sees what a GPU step would read inside it)."""
    if not isinstance(stats.loss_sum, torch.Tensor):
        return stats
    if not stats.loss_sum.is_cuda:  # free on the host
        stats.loss_sum = float(stats.loss_sum)
        stats.correct = stats.correct.item() if torch.is_tensor(stats.correct) else stats.correct
        return stats
    if isinstance(stats.correct, torch.Tensor):
        stats.loss_sum, stats.correct = host_readout(stats.loss_sum, stats.correct)
    else:  # a step that did not count correct predictions (NaN)
        (stats.loss_sum,) = host_readout(stats.loss_sum)
    return stats


def host_readout(*sums):
    """`sums` (0-d device tensors) as HostValues: one small stack, one asynchronous copy
    into a pinned buffer (torch's caching host allocator reuses it) and one event."""
    pair = torch.stack([t.detach().double() for t in sums])
    host = torch.empty(pair.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(pair.device))  # the copy's stream, whatever
    # device is current on this thread
    return tuple(HostValue(host, i, done) for i in range(len(sums)))


def memory_figures(device: torch.device) -> dict[str, float]:
    """The CUDA allocator's peaks on a GPU rank (nothing on CPU: RSS covers it)."""
    if device.type != "cuda":
        return {}
    return {
        "mem_cuda_peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
        "mem_cuda_peak_reserved_bytes": float(torch.cuda.max_memory_reserved(device)),
    }
