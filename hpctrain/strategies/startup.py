"""What the startup line says about a run, and the warnings for what does nothing.

Every strategy's `describe()` states the same settings in the same words (ZeRO with its
stage and the axis it shards over, precision, compression), so the first line of a run
says what is on; `noop_warnings` names what the configuration asks for but this layout
makes a no-op (ZeRO over one replica shards nothing; compression, hierarchical
allreduce and local SGD with one replica exchange nothing; `parallel.expert` without
mixture-of-experts layers), each with what to change.
"""

from __future__ import annotations

from ..backends.gradient_engine import join_words
from ..backends.horovod_env import keys_set
from ..exchange.compression import LOSSY
from ..models import zoo

ZERO_SHARDS = {
    1: "the optimizer state",
    2: "the optimizer state and gradients",
    3: "the optimizer state, gradients and parameters (gathered per unit ahead of use)",
}
PRECISION = {
    "fp32": "fp32",
    "bf16": "bf16 (float32 master weights)",
    "fp16": "fp16 (dynamic loss scaling)",
}


def replica_axis(grid) -> str:
    """The grid axes the dense replicas span (ZeRO shards over them, gradients average
    over them): `data`, or `data x expert` when experts spread over ranks."""
    return "data" if grid.shape.expert == 1 else "data x expert"


def settings_text(cfg, axis: str | None = None, ranks: int = 1) -> str:
    """'ZeRO-1 shards the optimizer state over data (2 ranks), precision fp32,
    compression none': the settings every startup line states."""
    t = cfg.train
    zero = t["zero"]
    if not zero:
        parts = ["ZeRO off"]
    else:
        over = f" over {axis} ({ranks} rank{'s' if ranks != 1 else ''})" if axis else ""
        parts = [f"ZeRO-{zero} shards {ZERO_SHARDS[zero]}{over}"]
    parts.append(f"precision {PRECISION.get(t['precision'], t['precision'])}")
    parts.append(f"compression {compression_text(cfg)}")
    return ", ".join(parts)


def compression_text(cfg) -> str:
    method, c = cfg.train["compression"], cfg["compression"]
    options = []
    if method in ("topk", "randomk"):
        options.append(f"ratio {c['ratio']:g}")
    if method == "powersgd":
        options.append(f"rank {c['rank']}")
    if method in LOSSY and c["error_feedback"]:
        options.append("error feedback")
    if method in LOSSY and c["warmup_steps"]:  # the 16-bit exchanges start at step 0
        options.append(f"dense for the first {c['warmup_steps']} steps")
    return f"{method} ({', '.join(options)})" if options else method


def noop_warnings(cfg, world, grid, replicas: int, per_replica: str, engine: str) -> list[str]:
    """What `cfg` turns on that does nothing in this layout, one sentence each.

    `replicas`: the dense replicas the gradients are averaged over (and ZeRO shards
    over); `per_replica`: the configuration keys that set the ranks of one replica
    (e.g. 'parallel.tensor=2'), for the advice; `engine`: the gradient engine chosen."""
    t, out = cfg.train, []
    if engine != "horovod" and (horovod := keys_set(cfg.horovod)):
        out.append(
            f"{', '.join(horovod)}: the gradients are averaged by {engine}, not Horovod: "
            f"{'this does' if len(horovod) == 1 else 'these do'} nothing"
        )
    warmup = cfg["compression"]["warmup_steps"]
    if warmup and t["compression"] not in (*LOSSY, "none"):
        out.append(
            f"compression.warmup_steps={warmup} does nothing with train.compression="
            f"{t['compression']}: the 16-bit exchange starts at step 0 (only the lossy "
            "compressors warm up dense)"
        )
    if replicas == 1:
        size = world.size
        where = (
            (f"{size} ranks" if size != 1 else "1 rank")
            + (f" with {per_replica}" if per_replica else "")
            + f" {'make' if size != 1 else 'makes'} one data-parallel replica "
            f"(grid {grid.describe()})"
        )
        more = f"launch {2 * size} ranks or more" + (f" (a multiple of {size})" if size > 1 else "")
        more += " to"
        if t["zero"]:
            out.append(
                f"train.zero={t['zero']} shards nothing: {where}, so every rank keeps "
                f"{ZERO_SHARDS[t['zero']].replace('the ', 'all the ', 1)}; {more} shard "
                "it, or set train.zero=0"
            )
        off = [
            what
            for what, on in (
                (f"train.compression={t['compression']}", t["compression"] != "none"),
                ("train.hierarchical", t["hierarchical"]),
                (f"train.sync_every={t['sync_every']} (local SGD)", t["sync_every"] > 1),
            )
            if on
        ]
        if off:
            out.append(
                f"{join_words(off)} {'does' if len(off) == 1 else 'do'} nothing: {where}, "
                f"so no gradients or parameters are exchanged; {more} exchange them"
            )
    elif t["hierarchical"]:
        layout = getattr(world, "layout", None)
        nodes = getattr(layout, "nodes", 1)
        if nodes < 2 or nodes == world.size:
            out.append(
                "train.hierarchical does nothing here: "
                + ("all ranks run on one node" if nodes < 2 else "every node runs one rank")
                + ", so the gradients are averaged by one flat allreduce (it pays off with "
                "several ranks on each of several nodes)"
            )
    expert = cfg.parallel["expert"]
    if expert is not None and expert > 1 and not zoo.has_moe(cfg.model):
        out.append(
            f"parallel.expert={expert} does nothing: model {cfg.model['name']} has no "
            "mixture-of-experts layers (model.moe), so no experts are spread over ranks"
        )
    return out
