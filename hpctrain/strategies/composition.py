"""The rules of composition: which strategy, engine, compression, ZeRO, tensor and
precision settings run together, checked on every rank before any work (the config
calls `refusals`). Import-light: the configuration schema reads it.

Each strategy states its own refusals (`data_parallel`, `pipeline`, `parameter_server`
below, one function each, in `BY_STRATEGY`); the features that several strategies share
(ZeRO, tensor parallelism, half precision, the process-group engines, GPU ranks) state
theirs once, naming the strategies they run under. What needs the world size (a
pipeline's ranks, a parameter server's workers) the strategy checks when it starts
(`shape.JobShape`; `runtime.grid.GridShape` is the axes of the process grid).
"""

from __future__ import annotations

# strategies that shard dense data-parallel training (ZeRO, tensor parallelism)
DENSE = ("data_parallel", "pipeline")
# train.compression values the Horovod engine also carries (the pipeline refuses fp16)
DENSE_COMPRESSION = ("none", "fp16")


def _clash(pairs) -> list[str]:
    return [what for what, bad in pairs if bad]


def _model(v: dict) -> dict:
    return v["model"] if isinstance(v["model"], dict) else {}


def _moe(v: dict) -> bool:
    from ..models.zoo import has_moe  # lazy, as this module's other zoo reads

    return has_moe(_model(v))


# --- each strategy's own refusals --------------------------------------------------------
def data_parallel(v: dict) -> list[str]:
    return []  # every feature below runs under data parallelism


def pipeline(v: dict) -> list[str]:
    t, problems = v["train"], []
    if t["grad_accum"] != 1:
        problems.append(
            "train.grad_accum: the pipeline accumulates over pipeline.microbatches; "
            "leave train.grad_accum at 1"
        )
    # its stages average dense float32 gradients over their replicas, flat: a setting
    # for another exchange would be accepted and silently do nothing
    if t["compression"] == "fp16":  # the lossy ones: compression_rules
        problems.append(
            f"train.compression={t['compression']}: the pipeline's stages average dense "
            "gradients; compression runs with strategy data_parallel"
        )
    if t["hierarchical"]:
        problems.append(
            "train.hierarchical: the pipeline's stages average over their replicas with a "
            "flat allreduce; hierarchical allreduce runs with strategy data_parallel"
        )
    if t["zero"] > 1:
        problems.append(
            f"train.zero={t['zero']}: the pipeline shards with ZeRO-1 (optimizer state); "
            "ZeRO-2 and 3 would reduce-scatter (and ZeRO-3 also gather) every "
            f"micro-batch's, pipeline.microbatches={v['pipeline']['microbatches']} times a "
            "step's traffic (DeepSpeed refuses ZeRO-2/3 with its pipeline engine too)"
        )
    if _moe(v) and (t["zero"] or t["allreduce"] in ("horovod", "overlap")):
        problems.append(
            "model.moe: mixture-of-experts blocks inside pipeline stages run without ZeRO "
            "on the mpi engine or the process groups' (train.allreduce mpi, auto, gloo or "
            "nccl; train.zero 0)"
        )
    return problems


def parameter_server(v: dict) -> list[str]:
    """What the servers' flat optimizer and float32 transport cannot do, refused before
    any rank starts. The one refusal that needs the world size (a worker left beside
    the servers) is ps.runner.config_problems."""
    t, problems = v["train"], []
    if t["clip_norm"] is not None:
        problems.append(
            f"train.clip_norm={t['clip_norm']}: the parameter server does not clip "
            "gradients; leave train.clip_norm null, or clip with strategy data_parallel"
        )
    if t["compression"] != "none" and t["compression"] in DENSE_COMPRESSION:  # others: below
        problems.append(
            f"train.compression={t['compression']}: gradients travel as float32 with the "
            "parameter server; leave train.compression none"
        )
    if v["data"]["source"] == "benchmark":
        problems.append(
            "data.source=benchmark: not with the parameter server; use data.source "
            "synthetic or hdf5"
        )
    problems += _parameter_server_models(v)
    return problems


def _parameter_server_models(v: dict) -> list[str]:
    """Servers build the parameter layout without a framework: zoo models only, and each
    worker's backend one hpctrain has."""
    from ..backends import BACKENDS
    from ..models.zoo import is_zoo_model

    name, problems = _model(v).get("name", ""), []
    if not is_zoo_model(name):
        problems.append(
            f"model.name={name}: the parameter server trains zoo models only (mlp, cnn, "
            "resnet, transformer): servers build the parameter layout without a framework"
        )
    for b in v["ps"]["backends"] or []:
        if b not in BACKENDS:
            problems.append(f"ps.backends: {b!r} is not one of {', '.join(BACKENDS)}")
    return problems


BY_STRATEGY = {
    "data_parallel": data_parallel,
    "pipeline": pipeline,
    "parameter_server": parameter_server,
}


# --- features shared between strategies ---------------------------------------------------
def engine_rules(v: dict) -> list[str]:
    """Horovod's flags, what the horovod and overlap engines cannot carry, and the MPI
    engine's hierarchical allreduce."""
    t, problems = v["train"], []
    engine, compression = t["allreduce"], t["compression"]
    # the process-group engines are torch's: TensorFlow is not sent to them
    groups = ["gloo", "nccl"] if v["backend"] == "torch" else []
    if engine == "overlap" and compression != "none":
        others = [*groups, *(["horovod"] if compression == "fp16" else [])]
        problems.append(
            f"train.allreduce=overlap sends dense float32 buckets: train.compression="
            f"{compression} runs on train.allreduce=mpi (after backward)"
            + "".join(f", {e}" for e in others[:-1])
            + (f" or {others[-1]}" if others else "")
        )
    if engine == "horovod" and compression not in DENSE_COMPRESSION:
        problems.append(
            f"train.compression={compression}: Horovod compresses only to fp16; use "
            f"train.allreduce=mpi (or {', '.join(['auto', *groups])}) for it"
        )
    if v["horovod"]["hierarchical_allreduce"]:
        problems.append(
            "horovod.hierarchical_allreduce: Horovod implements hierarchical allreduce only "
            "in its GPU (NCCL) builds; on CPU the flag changes nothing: leave it false"
        )
    if t["hierarchical"] and (
        t["compression"] not in ("none",) or t["allreduce"] in ("horovod", "overlap")
    ):
        problems.append(
            "train.hierarchical: runs on train.allreduce=mpi (or auto) with train.compression=none"
        )
    return problems


def local_sgd_rules(v: dict) -> list[str]:
    t, problems = v["train"], []
    if t["sync_every"] > 1 and v["strategy"] != "data_parallel":
        problems.append(
            f"train.sync_every: local SGD runs with strategy data_parallel, not {v['strategy']}"
        )
    if t["sync_every"] > 1 and _moe(v):
        problems.append(
            "train.sync_every: local SGD with mixture-of-experts is not supported (experts "
            "live on one rank each; there is nothing to average them with)"
        )
    if t["sync_every"] > 1 and t["allreduce"] not in ("mpi", "auto"):  # auto: at the start
        problems.append(
            f"train.sync_every={t['sync_every']}: local SGD runs on the MPI engine "
            f"(train.allreduce=mpi or auto), not {t['allreduce']}"
        )
    return problems


def _dense_mpi_clash(v: dict) -> list[tuple[str, bool]]:
    """What ZeRO and tensor parallelism both refuse: another strategy, the horovod and
    overlap engines, compression, hierarchical allreduce, local SGD."""
    t, engine = v["train"], v["train"]["allreduce"]
    return [
        (f"strategy {v['strategy']}", v["strategy"] not in DENSE),
        (f"train.allreduce={engine}", engine in ("horovod", "overlap")),
        (f"train.compression={t['compression']}", t["compression"] != "none"),
        ("train.hierarchical", t["hierarchical"]),
        (f"train.sync_every={t['sync_every']}", t["sync_every"] > 1),
    ]


def offload_rules(v: dict) -> list[str]:
    """Offload moves a GPU rank's ZeRO shard optimizer (float32 master shard and its
    state) to host memory (backends/torch_offload.py): torch ZeRO on the process-group
    engines of GPU ranks; `optimizer+params` the ZeRO-3 parameter shard too. CPU ranks'
    state is in host memory already."""
    t = v["train"]
    offload = t["offload"]
    if offload == "none":
        return []
    if offload == "optimizer+params" and t["zero"] != 3:
        return [
            f"train.offload=optimizer+params: moves ZeRO-3's parameter shard to host "
            f"memory; train.zero={t['zero']} keeps whole parameters on the device, so "
            "use train.offload=optimizer there (the master shard and optimizer state)"
        ]
    if v["runtime"]["device"] == "cpu":  # auto: refused at start-up on CPU ranks
        from ..runtime.devices import offload_on_cpu

        return [offload_on_cpu(offload)]
    clash = _clash(
        (
            (f"backend {v['backend']}", v["backend"] != "torch"),
            ("train.zero=0", not t["zero"]),
            (f"train.allreduce={t['allreduce']}", t["allreduce"] not in ("auto", "nccl", "gloo")),
        )
    )
    if not clash:
        return []
    return [
        f"train.offload={offload}: offloads the torch backend's ZeRO-1/2/3 shard on GPU "
        f"ranks (train.allreduce nccl, gloo or auto); not with {', '.join(clash)}"
    ]


def zero_rules(v: dict) -> list[str]:
    zero = v["train"]["zero"]
    if zero == 3 and v["backend"] == "tensorflow":
        problem = _tensorflow_zero3(v)
        if problem:
            return [problem]
    clash = _clash(_dense_mpi_clash(v)) if zero else []
    if not clash:
        return []
    return [
        f"train.zero={zero}: ZeRO shards dense data-parallel training on the MPI "
        f"engine (strategy data_parallel, or pipeline with train.zero=1; "
        f"train.allreduce mpi or auto, or gloo/nccl with backend torch; no "
        f"compression, hierarchical allreduce or local SGD); not with {', '.join(clash)}"
    ]


def _tensorflow_zero3(v: dict) -> str | None:
    """TensorFlow's ZeRO-3 runs a zoo model unit by unit (backends/tensorflow_zero3.py):
    a Keras model's layers own their variables."""
    from ..models.zoo import is_zoo_model

    if not is_zoo_model(_model(v).get("name", "")):
        return (
            "train.zero=3 with backend tensorflow shards the zoo's models (a Keras "
            "model's layers own their variables): use backend torch, or train.zero=2"
        )
    return None


def tensor_rules(v: dict) -> list[str]:
    tensor, model = v["parallel"]["tensor"], _model(v)
    if tensor <= 1:
        return []
    pairs = _dense_mpi_clash(v)
    pairs.insert(1, (f"model {model.get('name')}", model.get("name") != "transformer"))
    clash = _clash(pairs)
    if clash:
        return [
            f"parallel.tensor={tensor}: tensor parallelism splits the zoo transformer "
            f"under strategy data_parallel or pipeline on the mpi, gloo or nccl engine; "
            f"not with "
            f"{', '.join(clash)}"
        ]
    from ..models.zoo import model_options
    from ..tensor.parallel import check_divisible

    problem = check_divisible(model_options(model), tensor)
    return [problem] if problem else []


def precision_rules(v: dict) -> list[str]:
    t, problems = v["train"], []
    half = t["precision"]
    if half == "fp16":
        clash = _clash(
            (
                (f"backend {v['backend']}", v["backend"] != "torch"),
                (f"train.allreduce={t['allreduce']}", t["allreduce"] == "horovod"),
                (f"train.zero={t['zero']}", t["zero"]),
                (f"parallel.tensor={v['parallel']['tensor']}", v["parallel"]["tensor"] > 1),
                # an overflow reaches every rank through the averaged gradients only: a
                # lossy compressor folds it into its residual or PowerSGD's Q (every
                # later step skipped), and local steps average no gradients
                (
                    f"train.compression={t['compression']}",
                    t["compression"] not in DENSE_COMPRESSION,
                ),
                (f"train.sync_every={t['sync_every']}", t["sync_every"] > 1),
            )
        )
        if clash:
            problems.append(
                "train.precision=fp16: dynamic loss scaling runs on the torch backend's "
                f"dense data parallel (not with {', '.join(clash)}); bf16 needs no "
                "loss scaling"
            )
    if half in ("bf16", "fp16"):
        # bf16 needs no loss scaling: the torch pipeline's stages autocast on their own
        pipeline_bf16 = half == "bf16" and v["strategy"] == "pipeline"
        if v["strategy"] != "data_parallel" and not (pipeline_bf16 and v["backend"] == "torch"):
            where = f"strategy {v['strategy']}"
            where += f" on backend {v['backend']}" if pipeline_bf16 else ""
            problems.append(
                f"train.precision={half}: runs with strategy data_parallel (bf16 also with "
                f"the torch backend's pipeline), not with {where}"
            )
        if _moe(v):
            problems.append(f"train.precision={half}: not with mixture-of-experts layers yet")
    return problems


def compression_rules(v: dict) -> list[str]:
    compression = v["train"]["compression"]
    if compression in DENSE_COMPRESSION or v["strategy"] == "data_parallel":
        return []
    return [
        f"train.compression={compression}: only with strategy "
        f"data_parallel (the {v['strategy']} strategy sends dense gradients)"
    ]


def process_group_rules(v: dict) -> list[str]:
    """The torch.distributed engines (nccl, gloo) average dense data-parallel gradients
    (compressed or not), run ZeRO-1/2/3 and sum tensor-parallel activations over their
    process groups (backends/torch_transport.py); the features that run on the MPI
    exchange layer only are refused with them."""
    engine, train = v["train"]["allreduce"], v["train"]
    if engine not in ("nccl", "gloo"):
        return []
    # what runs on the process groups' transports is not a clash
    from ..runtime.devices import mpi_only_features

    dp = v["strategy"] == "data_parallel"  # the pipeline: its links, replicas, ZeRO-1
    pipe = v["strategy"] == "pipeline"  # its compression and hierarchy: pipeline() refuses
    moe = _moe(v)
    on_groups = {
        **v,
        # experts (of data parallelism and of pipeline stages) exchange tokens over the
        # expert axis's group (the expert x tensor ranks' with tensor parallelism)
        "model": {**_model(v), "moe": None} if moe else v["model"],
        "train": {
            **train,
            "zero": 0 if dp or pipe else train["zero"],
            "compression": "none" if dp or pipe else train["compression"],
            "hierarchical": False if pipe else train["hierarchical"],
        },
        "parallel": {**v["parallel"], "tensor": 1},
    }
    clash = _clash(
        (
            (f"backend {v['backend']}", v["backend"] != "torch"),
            (f"strategy {v['strategy']}", v["strategy"] not in ("data_parallel", "pipeline")),
        )
    ) + mpi_only_features(on_groups)
    if not clash:
        return []
    return [
        f"train.allreduce={engine}: the process-group engine runs the torch backend's "
        "data parallelism (with ZeRO-1/2/3 and gradient compression), the pipeline, "
        f"tensor parallelism and experts; not with {', '.join(clash)} (those run on "
        "train.allreduce=mpi or auto)"
    ]


def device_rules(v: dict) -> list[str]:
    """runtime.device=cuda asks for GPU ranks: refused here, on every rank, when the
    layout cannot run on them (auto then stays on the CPU)."""
    from ..runtime.devices import gpu_unsupported

    cuda = v["runtime"]["device"] == "cuda"
    why = gpu_unsupported(v) if cuda else None
    problems = [f"runtime.device=cuda: {why}"] if why else []
    if cuda and not why and v["train"]["allreduce"] == "auto":  # auto is nccl on GPU ranks
        problems += process_group_rules({**v, "train": {**v["train"], "allreduce": "nccl"}})
    if v["train"]["allreduce"] == "nccl" and v["runtime"]["device"] == "cpu":
        problems.append(
            "train.allreduce=nccl: NCCL needs GPU ranks, not runtime.device=cpu; on CPU ranks "
            "use train.allreduce=gloo"
        )
    return problems


def refusals(v: dict) -> list[str]:
    """Every rule above, in the order a user reads them (a validated config's dict)."""
    problems = engine_rules(v)
    problems += BY_STRATEGY[v["strategy"]](v)
    problems += local_sgd_rules(v) + process_group_rules(v) + device_rules(v)
    problems += (
        zero_rules(v)
        + offload_rules(v)
        + tensor_rules(v)
        + precision_rules(v)
        + compression_rules(v)
    )
    return problems
