"""The memory plan: what one rank will hold at its peak, for each ZeRO stage, before any
memory is allocated (`hpctrain plan-memory`, and the limit check before the model is built).

Terms, per rank, in bytes (float32 training; Psi: the dense parameters a data-parallel
rank trains, after tensor-parallel splitting; N: the data-parallel ranks; s: optimizer
slots, 1 SGD with momentum, 2 Adam; MoE experts, local to their rank, are replicated
state on top):

- parameters: 4 Psi; stages 1 and 2 add the optimizer's own shard, 4 Psi/N; stage 3
  keeps 4 Psi/N and gathers units into two slots of the largest unit's size
  (`gathered`: the running unit and the prefetched one);
- gradients: stage 0: 4 Psi in `param.grad` + 4 Psi of the MPI engine's flat buffer;
  stage 1: 4 Psi (one flat gradient) + 4 Psi/N (the shard's mean); stage 2: 4 Psi/N +
  the largest segment + the largest gradient being copied; stage 3: 4 Psi/N + the
  largest unit's gradient + the largest gradient being copied;
- optimizer state: 4 s Psi (stage 0) or 4 s Psi/N;
- activations: the most one micro-batch's tensors take at once over its forward, loss
  and backward: what autograd holds for backward, the temporaries beside it and one
  parameter's gradient as it lands (counted by the backend on torch's fake tensors: no
  memory, the step's shapes and dtypes);
- transients, the larger of: the optimizer step's temporaries (torch's fused Adam
  makes none; SGD one the size of what it steps, with weight decay) and the exchange's
  scratch (Open MPI's reduce-scatter allocates about twice the segment it reduces; an
  in-place allreduce about half the buffer; measured on this machine, Open MPI 4.1);
- baseline: the process's resident bytes before the model (the interpreter, torch, MPI,
  the data pipeline), measured by the process itself.

On a GPU rank every term is GPU memory (the CUDA allocator's) and the baseline host
memory; its transients are SGD's weight-decay temporaries only (the exchange's buffers
are NCCL's own or Gloo's host staging). `train.offload: optimizer` (ZeRO-1/2/3 on GPU
ranks, backends/torch_offload.py) moves the optimizer state and its step's temporaries
off the GPU: they become `offloaded`, host memory beside the baseline (the float32
master shard, a host copy of the gradient shard, and the slots: 4 (2 + s) Psi/N);
`optimizer+params` (ZeRO-3) also takes the parameter shard off the GPU, which keeps two
staging pieces of the largest unit instead.

Each term is what the code allocates (exchange/zero.py, backends/torch_zero*.py); the
test compares the total with the peak RSS a real run reaches (tests/test_memory_plan_jobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .zero import stage2_segments, unit_plan

SLOTS = {"sgd": 1, "adam": 2}
STAGES = (0, 1, 2, 3)
TERMS = ("parameters", "gathered", "gradients", "optimizer", "activations", "transients")
HOST = "offloaded"  # host bytes a GPU rank's offload holds, outside `total`


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its dense parameters' elements on this rank
    (registration order), which of them each layer holds (forward order), the experts'
    elements and the most bytes one micro-batch takes at once (its activations)."""

    sizes: list[int]
    layers: list[list[int]] = field(default_factory=list)
    expert_elements: int = 0
    activation_bytes: int = 0


def _padded(elements: int, n: int) -> int:
    return -(-max(elements, 1) // n) * n


def _optimizer_slots(optimizer: dict) -> int:
    if optimizer["name"] == "sgd" and not optimizer.get("momentum"):
        return 0
    return SLOTS[optimizer["name"]]


def _step_temporaries(optimizer: dict, stepped: float) -> float:
    """Bytes torch's optimizers allocate during `step()` (see the module doc)."""
    if optimizer["name"] == "adam":
        return 0.0  # fused (backends/torch_steps.make_optimizer): in place
    return stepped if optimizer.get("weight_decay") else 0.0


def plan_stage(
    shape: ModelShape,
    n: int,
    stage: int,
    optimizer: dict,
    unit_bytes: int,
    bucket_bytes: int,
    offload: str = "none",
    gpu: bool = False,
) -> dict[str, float]:
    """The terms of one stage (bytes per rank), their sum (`total`, no baseline) and
    what `offload` keeps in host memory instead (`offloaded`; ZeRO stages only). `gpu`:
    the terms of a GPU rank (no exchange scratch in the CUDA allocator)."""
    psi = sum(shape.sizes)
    full, shard = 4.0 * psi, 4.0 * _padded(psi, n) / n
    largest = 4.0 * max(shape.sizes, default=0)
    slots = _optimizer_slots(optimizer)
    experts = 4.0 * shape.expert_elements  # local to this rank: weights, gradients, state
    gathered = segment = 0.0
    if stage == 3:
        layers = shape.layers or [list(range(len(shape.sizes)))]
        units = [
            4.0 * _padded(sum(shape.sizes[i] for m in u for i in layers[m]), n)
            for u in unit_plan(layers, shape.sizes, unit_bytes)
        ]
        gathered, segment = 2 * max(units), max(units)  # two slots of the largest unit
    elif stage == 2:
        segment = max(
            4.0 * _padded(sum(shape.sizes[i] for i in g), n)
            for g in stage2_segments(shape.sizes, bucket_bytes)
        )
    params = {0: full, 1: full + shard, 2: full + shard, 3: shard}[stage]
    # plain data parallelism's exchange buffer is filled only where there is a peer
    # (one process: never written, so neither resident nor in the CUDA allocator)
    grads = {
        0: 2 * full if n > 1 else full,
        1: full + shard,
        2: shard + segment,
        3: shard + segment,
    }[stage]
    grads += largest if stage >= 2 else 0.0  # the gradient being copied into its segment
    opt = slots * (full if stage == 0 else shard)
    temps = _step_temporaries(optimizer, full if stage == 0 else shard)
    scratch = {0: full / 2, 1: 2 * full, 2: 2 * segment, 3: 2 * segment}[stage] if n > 1 else 0.0
    if gpu:  # NCCL's buffers and Gloo's host staging are not in the CUDA allocator
        scratch = 0.0
    offloaded = 0.0
    if offload != "none" and stage > 0:  # the host's master, gradient copy and slots
        offloaded, opt, temps = (2 + slots) * shard, 0.0, 0.0
    if offload == "optimizer+params" and stage == 3:  # the master is the shard: staged
        params = gathered / n  # two pieces of the largest unit, one per slot
    out = {
        "parameters": params + experts,
        "gathered": gathered,
        "gradients": grads + experts,
        "optimizer": opt + slots * experts,
        "activations": float(shape.activation_bytes),
        "transients": max(temps, scratch),
    }
    out["total"] = sum(out[t] for t in TERMS)
    out[HOST] = offloaded
    return out


def table(
    plans: dict[int | str, dict],
    baseline: float,
    limit: float | None = None,
    gpu: bool = False,
    gpu_limit: float | None = None,
) -> str:
    """The plans as a text table in MiB, one row per stage (a ZeRO stage, or a row's
    label: a pipeline's stages). On CPU ranks the peak is the
    baseline plus every term, marked against `limit`; with `gpu` the terms are the GPU's
    peak (marked against `gpu_limit`) and the host holds the baseline and what offload
    moved there (marked against `limit`)."""
    mib = 1 << 20
    tail = ["GPU peak", HOST, "baseline", "host peak"] if gpu else ["baseline", "peak"]
    head = ["stage", *TERMS, *tail]
    rows = [head]

    def marked(value: float, bound: float | None) -> str:
        text = f"{value / mib:,.0f}"
        if bound is None:
            return text
        return text + (" (fits)" if value <= bound else " (over the limit)")

    for stage, p in plans.items():
        label = stage if isinstance(stage, str) else f"ZeRO-{stage}" if stage else "plain"
        row = [label, *(f"{p[t] / mib:,.0f}" for t in TERMS)]
        host = baseline + p.get(HOST, 0.0)
        if gpu:
            row += [marked(p["total"], gpu_limit), f"{p.get(HOST, 0.0) / mib:,.0f}"]
        row += [f"{baseline / mib:,.0f}", marked(host if gpu else host + p["total"], limit)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
