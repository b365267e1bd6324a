"""Which device a rank computes on: the rule, free of any framework.

One rank per GPU, as NCCL requires (two ranks on one GPU make NCCL fail or hang at the
first collective). A rank that sees exactly one GPU uses it whatever its local rank
(`CUDA_VISIBLE_DEVICES`, SLURM's `--gpus-per-task 1`). Where ranks see several, the
node's ranks share the lists of GPUs each sees and take one each (`assign_gpus`), so
SLURM's `--gpu-bind=closest` (each rank sees its socket's GPUs) works too. More ranks
than GPUs on a node is refused before any work, naming the node and the counts, unless
the gradient engine stages through host memory (the `mpi` and `gloo` engines), which
tolerate sharing (tests, or a node with fewer GPUs than cores).

Cost: a rule evaluated locally, after one allgather of GPU ids within each node (~40
bytes a GPU a rank: its cost grows with the ranks per node, the same at 1,024 or 4,096
ranks); the caller's one agreement on errors is O(log N).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
# The layouts whose device code runs on CPU ranks (Gloo) and in one GPU process, but has
# not run across ranks on a GPU yet, start on GPU ranks only with this set to 1 (the GPU
# check sets it for tests/test_gpu_jobs.py, which verifies them).
GPU_UNTESTED = "HPCTRAIN_GPU_UNTESTED"
# Engines that move gradients through host memory (Gloo copies CUDA tensors to the host
# itself): they tolerate ranks sharing a GPU.
HOST_STAGED_ENGINES = ("mpi", "gloo", "auto")


@dataclass(frozen=True)
class DeviceChoice:
    kind: str  # "cpu" | "cuda"
    index: int | None  # the CUDA ordinal this rank uses (among the visible GPUs)
    reason: str


def choose_device(
    wanted: str,
    visible_gpus: int,
    local_rank: int,
    local_size: int,
    hostname: str,
    engine: str,
    supported: str | None = None,
    node_gpus: list[list[str]] | None = None,
) -> DeviceChoice:
    """The device for this rank.

    wanted: `runtime.device`. visible_gpus: GPUs this process can see (0 without CUDA).
    supported: None when the layout can run on a GPU, else why not (auto then stays on
    the CPU; `cuda` is refused with it). node_gpus: the ids of the GPUs each rank of
    the node sees, in node-rank order, `local_rank` being this rank's place in it (None:
    one process, or the node's ranks all see the same GPUs in the same order).
    """
    if wanted not in DEVICES:
        raise ConfigError(f"runtime.device: expected one of {', '.join(DEVICES)}, got {wanted!r}")
    if wanted == "cpu":
        return DeviceChoice("cpu", None, "runtime.device=cpu")
    if visible_gpus == 0:
        if wanted == "cuda":
            raise ConfigError(
                f"runtime.device=cuda: no usable CUDA GPU on {hostname} (torch sees none; "
                "check CUDA_VISIBLE_DEVICES, the driver, and that torch is a CUDA build)"
            )
        return DeviceChoice("cpu", None, "auto: no CUDA GPU visible")
    if supported is not None:
        if wanted == "cuda":
            raise ConfigError(f"runtime.device=cuda: {supported}")
        return DeviceChoice("cpu", None, f"auto: {supported}")
    if visible_gpus == 1:
        return DeviceChoice("cuda", 0, f"{wanted}: the one GPU this rank sees")
    gpus = len({g for seen in node_gpus for g in seen}) if node_gpus else visible_gpus
    if local_size > gpus and engine not in HOST_STAGED_ENGINES:
        raise ConfigError(
            f"runtime.device: node {hostname} runs {local_size} ranks but has "
            f"{gpus} GPUs; NCCL needs one GPU per rank (launch at most "
            f"{gpus} ranks per node, or use train.allreduce=mpi to share GPUs "
            "through host memory)"
        )
    if node_gpus:
        index = assign_gpus(node_gpus)[local_rank]
        why = f"{wanted}: GPU {index} of the {visible_gpus} it sees (one each on the node)"
        return DeviceChoice("cuda", index, why)
    index = local_rank % visible_gpus
    return DeviceChoice("cuda", index, f"{wanted}: GPU {index} of {visible_gpus} (local rank)")


def assign_gpus(seen: list[list[str]]) -> list[int | None]:
    """For each rank of a node (node-rank order), the index, among the GPUs *it* sees,
    of the GPU it uses (None where it sees none): one no earlier rank took where it can,
    trying first its node rank's place among them (where ranks that all see every GPU
    land, as before), else the least used. Picking by local rank alone put two ranks of a
    socket on one GPU under SLURM's --gpu-bind=closest (ranks 0 and 2 seeing the same
    two GPUs both took the first)."""
    used: dict[str, int] = {}
    out: list[int | None] = []
    for rank, gpus in enumerate(seen):
        if not gpus:
            out.append(None)
            continue
        order = [(rank + k) % len(gpus) for k in range(len(gpus))]
        best = min(order, key=lambda i: used.get(gpus[i], 0))  # the first of the least used
        used[gpus[best]] = used.get(gpus[best], 0) + 1
        out.append(best)
    return out


@dataclass(frozen=True)
class Feature:
    """A feature beyond dense data parallelism that hpctrain's own exchange layer runs
    (Horovod's engine does not). `label`: as the config names it; `words`: as a user
    would (the gradient engine's reasons); `host_only`: its code exchanges host arrays,
    so it never runs on GPU ranks; `needs_mpi`: `allreduce: auto` picks the MPI engine
    for it on CPU ranks (experts exchange tokens beside any engine; compression has its
    own rule, gradient_engine.choose)."""

    label: str
    words: str
    host_only: bool = False
    needs_mpi: bool = True


def exchange_features(cfg) -> list[Feature]:
    """The features `cfg` (a Config or its dict) turns on, from one table: the gradient
    engine's choice, the process-group and GPU rules all read it."""
    train, model = cfg["train"], cfg["model"]
    tensor, zero, compression = cfg["parallel"]["tensor"], train["zero"], train["compression"]
    sync = train["sync_every"]
    table = (
        (Feature(f"train.zero={zero}", f"ZeRO-{zero}"), zero),
        (Feature(f"parallel.tensor={tensor}", f"tensor parallelism (parallel.tensor={tensor})"),
         tensor > 1),
        (Feature("mixture-of-experts layers", "mixture-of-experts layers", needs_mpi=False),
         isinstance(model, dict) and model.get("moe") is not None),  # zoo.has_moe
        (Feature(f"train.compression={compression}", f"train.compression={compression}",
                 needs_mpi=False), compression != "none"),
        (Feature("train.hierarchical", "hierarchical allreduce", host_only=True),
         train["hierarchical"]),
        (Feature(f"train.sync_every={sync}", f"local SGD (train.sync_every={sync})",
                 host_only=True), sync > 1),
    )  # fmt: skip
    return [feature for feature, on in table if on]


def mpi_only_features(cfg) -> list[str]:
    """The labels of `exchange_features`: what the process-group engines and GPU ranks
    check against what they run."""
    return [f.label for f in exchange_features(cfg)]


def gpu_unsupported(cfg, untested_ok: bool = False) -> str | None:
    """Why this configuration (a Config or its dict) cannot run on GPU ranks (None: it
    can). One rule for the config check and the device choice. untested_ok: as if
    GPU_UNTESTED were set (what no installation of this hpctrain runs on GPU ranks).

    On GPU ranks the torch backend's data parallelism runs dense, ZeRO-1/2/3, tensor
    parallelism, experts and compression on the process-group engines (their buffers on
    the device: `nccl`, or `gloo`, which stages CUDA tensors through the host itself);
    the host-staged `mpi` engine averages dense gradients only. The pipeline's stages
    compute on the device and exchange over the process groups, NCCL's or Gloo's (with
    or without tensor parallelism, ZeRO-1 or experts). The
    parameter server, hierarchical allreduce and local SGD exchange host arrays. What
    has not run across ranks on a GPU yet waits for GPU_UNTESTED."""
    if cfg["backend"] != "torch":
        return f"the {cfg['backend']} backend trains on CPU ranks only (no GPU build tested)"
    if cfg["strategy"] not in ("data_parallel", "pipeline"):
        return f"strategy {cfg['strategy']} runs on CPU ranks only so far"
    engine = cfg["train"]["allreduce"]
    if cfg["strategy"] == "pipeline":
        why = _pipeline_on_gpu(cfg)
        if why:
            return why
    elif engine in ("horovod", "overlap"):
        return (
            f"GPU ranks average on train.allreduce=nccl (or gloo, mpi), not with "
            f"train.allreduce={engine}"
        )
    found = exchange_features(cfg)
    features = [f.label for f in found]
    host_only = [f.label for f in found if f.host_only]
    if host_only:
        return f"GPU ranks do not run {', '.join(host_only)} yet (host-side code)"
    if engine == "mpi" and features:
        return (
            f"train.allreduce=mpi stages dense gradients through the host; "
            f"{', '.join(features)} run on GPU ranks with train.allreduce=nccl (or auto)"
        )
    untested = gpu_untested(cfg)
    if untested and not untested_ok and os.environ.get(GPU_UNTESTED) != "1":
        return (
            f"{', '.join(untested)} on GPU ranks: not yet run across ranks on a GPU "
            f"(tools/gpu_check.sh runs them; {GPU_UNTESTED}=1 on every rank runs them anyway)"
        )
    return None


def _pipeline_on_gpu(cfg) -> str | None:
    """Why the pipeline's stages cannot run on GPU ranks with `cfg` (None: they can):
    they compute on the GPU and exchange over a process group's links, NCCL's on the
    device (one GPU per rank) or Gloo's through the host (ranks sharing a GPU)."""
    engine, train = cfg["train"]["allreduce"], cfg["train"]
    host = (
        (f"train.allreduce={engine}", engine in ("mpi", "horovod", "overlap")),
        (f"train.compression={train['compression']}", train["compression"] != "none"),
    )
    clash = [what for what, on in host if on]
    if not clash:
        return None
    verb = "exchanges" if len(clash) == 1 else "exchange"
    return (
        f"the pipeline's stages run on GPU ranks over train.allreduce=nccl, gloo or auto "
        f"(ZeRO-1 and experts too); {', '.join(clash)} {verb} host arrays "
        "(CPU ranks)"
    )


def offload_on_cpu(offload: str) -> str:
    """The refusal of offload on CPU ranks: said by the config check for
    runtime.device=cpu (strategies/composition.py) and at start-up where `auto` found no
    GPU or kept the ranks on the CPU (backends/torch_device.py)."""
    return (
        f"train.offload={offload}: offloading moves a GPU rank's optimizer state to host "
        "memory; CPU ranks keep it in host memory already, so there is nothing to "
        "offload: leave train.offload=none (or run on GPU ranks)"
    )


def gpu_untested(cfg) -> list[str]:
    """What `cfg` turns on that GPU ranks run on the process-group code but that has not
    yet run across ranks on a GPU (it starts there with GPU_UNTESTED=1)."""
    offload = cfg["train"]["offload"]
    gloo = cfg["train"]["allreduce"] == "gloo"
    pipeline = cfg["strategy"] == "pipeline"
    return (
        (["strategy pipeline"] if pipeline else [])
        + mpi_only_features(cfg)
        + ([f"train.offload={offload}"] if offload != "none" else [])
        + (["train.allreduce=gloo"] if gloo else [])
    )
