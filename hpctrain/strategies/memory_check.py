"""Refuse, before any compute, a run whose model state will not fit a rank's memory.

A rank that outgrows its cgroup is SIGKILLed by the kernel mid-step: the job ends with
a lost rank and no reason. Parameters, gradients and optimizer state are known once the
model and optimizer are built (the ZeRO paper's accounting, per rank, after ZeRO and
tensor-parallel sharding), so the check adds what is still to come to what is resident
now (the freed heap given back first) and compares it with the limit the
kernel will enforce. Activations and temporaries
are not counted: a run within 15% of its limit gets a warning instead of a refusal.

On a GPU rank the torch zoo models' plan is checked twice before the model is built:
its terms against the GPU memory the rank may use (free on its GPU, divided among the
node's ranks that share it), and the baseline plus what offload moves to the host
against the host limit.
"""

from __future__ import annotations

from ..exchange.memory_plan import HOST, TERMS
from ..models.zoo import is_zoo_model
from ..runtime import allocator
from ..runtime.memory import current_rss_bytes, physical_memory, rank_memory_limit
from .checkpoint_memory import checkpoint_hint

MIB = 1 << 20
WARN_FRACTION = 0.85


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def _to_come(plan: dict[str, float]) -> tuple[float, float]:
    """(gradients, optimizer state) bytes still to be allocated."""
    return (
        max(0.0, plan["grad"] - plan["grad_now"]),
        max(0.0, plan["optimizer"] - plan["optimizer_now"]),
    )


def memory_problem(
    plan: dict[str, float], resident: int, limit: int, source: str, hints: str, saves: float = 0
):
    """(refusal or None, warning or None) for one rank's plan against its limit.
    `saves`: host bytes this rank holds for a gathered checkpoint (checkpoint_memory.py)."""
    grads, opt = _to_come(plan)
    need = resident + grads + opt + saves
    figures = (
        f"about {_mib(need)} per rank ({_mib(resident)} resident now with the parameters, "
        f"+ {_mib(grads)} of gradients and {_mib(opt)} of optimizer state{_saving(saves)} "
        f"to come; activations not counted) against a limit of {_mib(limit)} ({source})"
    )
    return _verdict(need, limit, figures, hints, "; activations come on top")


def _saving(saves: float, lead: str = ", ") -> str:
    return f"{lead}{_mib(saves)} of the gathered checkpoint's copy" if saves else ""


def gpu_memory_problem(plan: dict[str, float], gpu: tuple[int, str], hints: str):
    """(refusal or None, warning or None) for a GPU rank whose model is on the GPU: what
    it will still allocate there against what is free for it now."""
    grads, opt = _to_come(plan)
    figures = (
        f"about {_mib(grads + opt)} more of GPU memory per rank ({_mib(grads)} of "
        f"gradients and {_mib(opt)} of optimizer state; activations not counted) against "
        f"{gpu[1]}"
    )
    return _verdict(grads + opt, gpu[0], figures, hints, "; activations come on top", "on the GPU")


def _verdict(need: float, limit: int, figures: str, hints: str, caveat: str = "", on: str = ""):
    """(refusal, None) over the limit, (None, warning) within 15% of it, else neither."""
    if need > limit:
        where = f" {on}" if on else ""
        return f"the model will not fit{where}: training needs {figures}. {hints}", None
    if need > WARN_FRACTION * limit:
        return None, f"memory is tight: training needs {figures}{caveat}"
    return None, None


def _limit(cfg, world) -> tuple[int, str] | None:
    if cfg.runtime["memory_limit_mb"] is not None:
        return int(cfg.runtime["memory_limit_mb"] * MIB), "runtime.memory_limit_mb"
    return rank_memory_limit(world.node)


def plan_problem(
    terms: dict[str, float], baseline: int, host, hints: str, gpu=None, saves: float = 0
):
    """(refusal or None, warning or None) for a memory plan (exchange/memory_plan.py).

    host: (bytes, source) of the rank's host limit, or None. gpu: (bytes, what) of the
    GPU memory this rank may use, or None on a CPU rank. A CPU rank's peak is the
    baseline plus every term; a GPU rank's terms are on the GPU, and its host holds the
    baseline and what offload moved there. `saves`: host bytes this rank holds for a
    gathered checkpoint (checkpoint_memory.py), on top on its host."""
    parts = ", ".join(f"{t} {_mib(terms[t])}" for t in TERMS if terms[t]) + _saving(saves)
    found = []
    if gpu is not None:
        figures = (
            f"about {_mib(terms['total'])} of GPU memory per rank at its peak ({parts}) "
            f"against {gpu[1]}"
        )
        found.append(_verdict(terms["total"], gpu[0], figures, hints, on="on the GPU"))
        parts = f"{HOST} {_mib(terms[HOST])}" + _saving(saves)  # the host's share
    if host is not None:
        need = baseline + (terms["total"] if gpu is None else terms[HOST]) + saves
        figures = (
            f"about {_mib(need)} per rank at its peak ({_mib(baseline)} resident before the "
            f"model + {parts}) against a limit of {_mib(host[0])} ({host[1]})"
        )
        found.append(_verdict(need, host[0], figures, hints))
    errors = [e for e, _ in found if e is not None]
    warnings = [w for _, w in found if w is not None]
    return (errors[0] if errors else None), ("; ".join(warnings) if warnings else None)


def check_memory_plan(
    cfg,
    world,
    plan_of,
    log,
    gpu_of=lambda: None,
    where: str = "",
    always: bool = False,
    saves_of=lambda gpu: 0.0,
    params: int | None = None,
) -> bool:
    """Before the model is built (collective): the plan of this rank's configured stage
    against its limits, errors agreed. `plan_of(on_gpu)`: (terms, baseline) or None
    where the backend cannot plan the model (then `check_memory` checks after the build).
    `gpu_of()` (collective over the node): (bytes, what) of the GPU memory this rank
    may use, None on CPU ranks. `where`: what part of the model this rank holds (a
    pipeline stage), put before its error or warning. `always`: plan where no limit is
    known too (the pipeline reports the plan beside its measured peak). `saves_of(on_gpu)`:
    host bytes this rank holds for a gathered checkpoint (checkpoint_memory.py), not
    part of the plan's terms. `params`: the whole model's parameter count, for the
    bound where no limit is known (`beyond_the_node`). Returns whether the plan was
    checked on every rank (agreed: one allreduce of a flag)."""
    if not cfg.runtime["memory_check"]:
        return True
    found = _limit(cfg, world)
    gpu = gpu_of()
    planned = error = None
    saves = 0.0
    if found is not None or gpu is not None or always:
        try:
            planned = plan_of(gpu is not None)
            saves = saves_of(gpu is not None) if planned is not None else 0.0
        except Exception as exc:  # agreed below: no rank waits for one that failed
            error = (
                f"the memory plan failed ({exc!r}): runtime.memory_check=false skips it "
                "(and please report the configuration)"
            )
    if planned is not None:
        hints = _hint_text(cfg, gpu is not None, saves, world.size)
        error, warning = plan_problem(*planned, found, hints, gpu, saves)
        if warning is not None:
            note = heap_note(cfg.train["zero"], allocator.keeps_freed(), cfg.strategy == "pipeline")
            log.warning(where + warning + note)
    if error is None and found is None and gpu is None:
        error = beyond_the_node(params, world.local_size, world.size, physical_memory())
    # one model on every rank (no `where`): N ranks' refusals, each with its own
    # baseline, are one line
    world.agree(None if error is None else where + error, merge_figures=not where)
    checked = (found is None and gpu is None) or planned is not None
    # agreed: where one rank has a limit (a cgroup on one node, a GPU whose budget could
    # not be read) and others none, every rank checks again after the build (collective)
    return not world.any_flag(not checked, "agree on the memory plan")


def beyond_the_node(params: int | None, local: int, size: int, physical: int | None):
    """Where no limit is known (no cgroup, no SLURM grant, no runtime.memory_limit_mb),
    a model whose float32 parameters alone exceed this node's memory even sharded over
    every rank of the job: a lower bound, so it never refuses a model that fits. Such a
    model was an allocator's traceback (or an overflow) at its build on a workstation."""
    if not params or not physical:
        return None
    share = 4 * params * local / size  # this node's ranks' part of the parameters
    if share <= physical:
        return None
    held = (
        f"even sharded over all {size} ranks of the job, this node's {local} would hold "
        f"{_gib(share)} of them"
        if size > 1
        else "all on one rank"
    )
    return (
        f"the model will not fit: its {params:,} parameters alone are {_gib(4 * params)} "
        f"in float32, {held}, and the node has {_gib(physical)} (no cgroup or SLURM "
        "limit is set; runtime.memory_limit_mb gives one to plan against): a smaller "
        "model, or more nodes"
    )


def _gib(n: float) -> str:
    return f"{n / (1 << 30):,.1f} GiB"


def heap_note(stage: int, keeps_freed: bool, pipeline: bool = False) -> str:
    """What a tight ZeRO-3 run or pipeline stage should know: the plan counts live
    memory, and the heap that keeps freed blocks for speed (runtime/allocator.py) peaked
    above it (tests/test_memory_plan_jobs.py: ZeRO-3 4-5%, a pipeline stage 5-15%, its
    gradients freed and its activations allocated between them every step); giving
    them back costs throughput (both measured here, 2 ranks on 2 cores)."""
    if not keeps_freed or not (pipeline or stage == 3):
        return ""
    what, above, within, speed = (
        ("a pipeline stage's", "5-15%", "3%", "0.79x")
        if pipeline
        else ("ZeRO-3's", "4-5%", "1%", "0.65x")
    )
    return (
        f". {what} heap keeps freed blocks for speed and peaked {above} above this plan "
        "in tests: export MALLOC_MMAP_THRESHOLD_=4194304 to give them back (the peak then "
        f"met the plan within {within}, at about {speed} the throughput)"
    )


def _hint_text(cfg, gpu: bool = False, saves: float = 0, size: int = 2) -> str:
    hints = ([checkpoint_hint(cfg.checkpoint, size)] if saves else []) + _hints(cfg, gpu)
    return "Shard it: " + ", ".join(hints) + "; or ask for more memory per rank."


def check_memory(strategy, log, gpu_of=lambda: None, saves: float = 0) -> None:
    """A data-parallel rank's check once its model is built (check_built)."""
    check_built(
        strategy.cfg, strategy.world, strategy.backend.memory_plan, log, gpu_of, saves=saves
    )


def check_built(
    cfg, world, memory_plan, log, gpu_of=lambda: None, where: str = "", saves: float = 0
) -> None:
    """Collective over the job, once the model exists: every rank checks its own plan
    (`memory_plan()`: a backend's or a pipeline stage's), errors are agreed. On a GPU
    rank (`gpu_of()`, collective over the node: what is free for it now) the state
    still to come is checked against the GPU, otherwise against the host's limit.
    `where`: the part of the model this rank holds, put before its error or warning.
    `saves`: host bytes this rank holds for a gathered checkpoint (checked on CPU ranks;
    a GPU rank's host is not checked here)."""
    if not cfg.runtime["memory_check"]:
        return
    found = _limit(cfg, world)
    gpu = gpu_of()
    error = warning = None
    hints = _hint_text(cfg, gpu is not None, saves if gpu is None else 0, world.size)
    if gpu is not None:
        error, warning = gpu_memory_problem(memory_plan(), gpu, hints)
    elif found is not None:
        # the freed heap given back first: what stays resident is held. (RSS less
        # glibc's free bytes undercounted after any trim: trimmed chunks stay counted as
        # free without pages; the torch backend trims once built. Cost: one malloc_trim.)
        allocator.give_back_freed()
        resident = current_rss_bytes()
        error, warning = memory_problem(memory_plan(), resident, found[0], found[1], hints, saves)
    if warning is not None:
        log.warning(where + warning)
    world.agree(None if error is None else where + error)


def _hints(cfg, gpu: bool = False) -> list[str]:
    if cfg.strategy == "pipeline":
        return _pipeline_hints(cfg)
    hints = []
    if cfg.train["zero"] < 2:
        hints.append(
            "train.zero=2 (gradients and optimizer state split over the data-parallel ranks)"
        )
    tf_shards = is_zoo_model(cfg.model["name"])  # TF's ZeRO-3 shards the zoo's models
    if cfg.train["zero"] < 3 and (cfg.backend == "torch" or tf_shards):
        hints.append("train.zero=3 (the parameters too, gathered a unit of layers at a time)")
    if gpu and cfg.backend == "torch" and cfg.train["offload"] == "none":
        hints.append("train.offload=optimizer (with ZeRO: optimizer state in host memory)")
    if cfg.model["name"] == "transformer":
        hints.append("parallel.tensor=T (the transformer's layers split over T ranks)")
    hints.append("fewer ranks per node")
    return hints


def _pipeline_hints(cfg) -> list[str]:
    """What shrinks a pipeline stage: fewer layers each, fewer micro-batches held, its
    optimizer state split over its replicas, its blocks split over tensor ranks."""
    p = cfg.pipeline
    hints = [f"more stages than pipeline.stages={p['stages']} (fewer layers on each)"]
    if p["schedule"] == "gpipe" and p["microbatches"] > p["stages"]:
        hints.append(
            f"pipeline.schedule=1f1b (a stage holds at most {p['stages']} micro-batches' "
            f"activations, not {p['microbatches']})"
        )
    if cfg.train["zero"] == 0:
        hints.append("train.zero=1 (with replicas: each stage's optimizer state split over them)")
    if cfg.model["name"] == "transformer":
        hints.append("parallel.tensor=T (each stage's blocks split over T ranks)")
    hints.append("smaller micro-batches (train.batch_size)")
    hints.append("fewer ranks per node")
    return hints
