"""What the memory plan needs of a torch zoo model, without allocating it: the model is
built of torch's fake tensors (shapes and dtypes, no memory), its parameters counted per
layer, and one micro-batch run through forward, loss and backward (_step_bytes).

The activations term is counted for the allocator that will hold them:
- a GPU rank: the most the micro-batch's tensors take at once, every tensor counted
  from the op that makes it to its last reference (_LiveBytes): what autograd holds
  for backward plus the temporaries beside it (the loss's over the logits, the
  gradients of activations, a checkpointed block's recomputation). That is the CUDA
  allocator's allocated figure, block for block.
- a CPU rank: what autograd saves, summed tensor by tensor, plus an allowance for a
  checkpointed block's recomputation (_recompute_bytes), the form measured against the
  peak RSS (tests/test_memory_plan_jobs.py, within 3-6%). RSS is glibc's heap, which
  keeps freed blocks for speed (runtime/allocator.py): its high-water mark lies above
  the live bytes wherever temporaries are large (measured in one process: a 6-block
  transformer of d_model 256 at 16 x 256 tokens peaked 715-731 MiB above its state with
  525 MiB live at most; with its blocks checkpointed 438-498 against 148 live; with
  freed blocks returned, MALLOC_MMAP_THRESHOLD_=4194304, 527 and 161). The saved sum
  counts views of one storage once each and so lands near the heap's mark (778 and
  429 there), where the live count would be 27-70% low.

Fake tensors rather than the meta device: they are CPU tensors to torch's dispatcher, so
`train.precision` bf16/fp16 runs under torch's own autocast, as the step does, with the
step's dtypes: half-size activations, and the half-precision copies of the weights the
matmuls keep until backward (on the meta device a bf16 plan was float32's: 11% low on
the 50 M transformer, one process). A GPU rank's plan runs the attention its step runs
there (torch's fused kernel, which keeps no sequence x sequence scores: the CPU step's
explicit softmax does). The one difference left on a GPU rank: the dtypes follow CPU
autocast's op lists (CUDA's keeps layer norms in float32; CPU's runs them in bf16): a
few bytes per token and channel per layer norm.

On an H100 the 100 M-parameter bf16 transformer of benchmarks/gpu_bench.py
(micro-batch 16 x 1,024 tokens, vocabulary 16,384) peaked at 9.90 GiB allocated
(20261128T024600Z-gpu-h100), where the meta device's plan said 27.2 GiB (float32, the
CPU attention's scores) and saved tensors alone at bf16 with the fused attention 8.1
(the loss's float32 logits and their gradients missing); the live count says 8.8, for
the step that no longer holds the logits through backward (that run's did: 1.5 GiB of
its peak). The GPU check's plan test (tests/test_gpu.py) measures it again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..exchange.memory_plan import ModelShape, plan_stage
from ..models import zoo
from ..moe.parallel import is_expert_param, local_layers
from ..tensor import parallel as tensor_parallel
from .groups import ModelGroups
from .torch_model import ZooNet
from .torch_steps import compute_precision, prepare_process, resident_baseline
from .torch_zero3 import module_params


def plan_shape(
    model_cfg: dict, inp: zoo.InputSpec, groups: ModelGroups, batch: int, seed=0,
    precision: str = "fp32", gpu: bool = False,
):  # fmt: skip
    """The ModelShape of this rank's part of a zoo model (None for a user's model), its
    activations those of a `precision` step on a GPU rank (`gpu`) or a CPU one."""
    if not zoo.is_zoo_model(model_cfg["name"]):
        return None
    layers = zoo.build_layers(model_cfg, inp)
    mine = tensor_parallel.local_layers(
        local_layers(layers, seed, groups.experts), groups.tensor.size
    )
    with FakeTensorMode():
        model = ZooNet(mine, groups, fused_attention=gpu)
        named = list(model.named_parameters())
        dense = [p for n, p in named if not is_expert_param(n)]
        # routing needs values, so a fake forward cannot run MoE layers: not counted
        saved = 0
        if not zoo.has_moe(model_cfg):
            saved = _activation_bytes(model, *_fake_batch(inp, batch), precision, gpu)
    return ModelShape(
        sizes=[p.numel() for p in dense],
        layers=module_params(model, dense),  # ZeRO-3's grouping of them into units
        expert_elements=sum(p.numel() for n, p in named if is_expert_param(n)),
        activation_bytes=saved,
    )


def _fake_batch(inp: zoo.InputSpec, batch: int):
    """(x, y) of `batch` samples, made inside the plan's FakeTensorMode (no memory)."""
    if inp.tokens:
        x = torch.zeros((batch, *inp.shape), dtype=torch.long)
        return x, torch.zeros_like(x)
    x = torch.zeros((batch, *inp.shape))
    return x, torch.zeros((batch,), dtype=torch.long)


def _activation_bytes(model, x, y, precision: str, gpu: bool, in_flight: int = 1) -> int:
    """The activations term of `in_flight` micro-batches like `x` held at once (a
    pipeline schedule's; 1 otherwise): on a GPU rank the others' held sets beside the
    most one micro-batch's tensors take at once (the CUDA allocator's figure); on a CPU
    rank what autograd saves for each and what checkpointed blocks take while
    recomputed (the module doc says why). `y` None: a pipeline stage before the last."""
    counted = _step_bytes(model, x, y, precision, backward=gpu)  # CPU: the saved sum
    if gpu:
        return (in_flight - 1) * counted.held + counted.peak
    return in_flight * counted.saved + _recompute_bytes(model, x, precision)


def _recompute_bytes(model, x, precision: str) -> int:
    """A CPU rank's allowance for activation checkpointing's backward: one block
    recomputed at a time, its saved set alive with the gradients flowing through it and
    the backward's temporaries, each about as many bytes: three times the largest
    checkpointed block's saved bytes (0 without checkpointing). Measured against the
    peak RSS (tests/test_memory_plan_jobs.py): twice left the plan 11-17% low on a
    4-block transformer at micro-batch 8 and 16. Called inside the plan's
    FakeTensorMode."""
    worst = 0
    for layer in model.seq:
        if layer.spec.attrs.get("recompute"):
            here = x.detach().requires_grad_(True)
            worst = max(worst, _step_bytes(layer, here, precision=precision, backward=False).saved)
        with torch.no_grad(), compute_precision(precision):
            x = layer(x)
    return 3 * worst


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors made while it is on, alive at once: each op's outputs
    counted by storage (a view shares its base's) until the last tensor on that storage
    is gone; `peak` is the most at the end of any op. Fake tensors are tensor
    subclasses, whose Python objects live as long as autograd holds them, so a tensor's
    end is its storage's. The same on real tensors (the test compares the two).
    Tensors on the storages of `existing` (a parameter's transpose) are not counted."""

    def __init__(self, existing=()):
        super().__init__()
        # storages made before (parameters, buffers, the input): views of them are free
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.refs: dict[int, int] = {}  # storage -> tensors on it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _gone(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.existing:
                    continue
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, storage.nbytes()
                    self.live += self.sizes[key]
                self.refs[key] += 1
                weakref.finalize(t, self._gone, key)
        self.peak = max(self.peak, self.live)
        return out


@dataclass(frozen=True)
class StepBytes:
    """One micro-batch through a model, in bytes (_step_bytes)."""

    saved: int  # what autograd saves, summed tensor by tensor (views too): a CPU rank's
    held: int  # alive after the forward, until its backward (storages counted once)
    peak: int  # the most alive at once over forward, loss and backward: a GPU rank's


def _step_bytes(model, x, y=None, precision: str = "fp32", backward: bool = True) -> StepBytes:
    """One micro-batch of `x` (fake tensors) through `model`: its forward under
    `precision`'s autocast, the loss on `y` in float32 (a whole model or a last stage;
    `y` None: a pipeline stage whose output is held until the next stage's gradient
    comes back), and its backward. `saved` sums what autograd saves for backward, the
    loss's, a stage's output; `held` and `peak` are _LiveBytes' counts: what the
    forward leaves alive, and the most alive at once: `held` plus the temporaries
    beside it (the loss's over the logits, the gradients of activations, a
    checkpointed block's recomputation) and one parameter's gradient at a time (each
    is dropped as it lands: the plan's gradients term counts them). A stage's input
    that requires grad is added to all three. `backward` False: forward and loss only
    (`saved` and `held` are known by then; `peak` is then the forward's), for CPU
    ranks, which plan with `saved`: half the trace's time."""
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t):
        seen[id(t)] = t.numel() * t.element_size()

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            keep(t)
        return t

    drops = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
        if p.requires_grad
    ]
    live = _LiveBytes([*model.parameters(), *model.buffers(), x])
    try:
        with live:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with compute_precision(precision):
                    out = model(x)
                root = out = out.float()
                if y is None:  # held until the next stage's gradient comes back
                    keep(out)
                else:  # the step keeps the loss only
                    root = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
                    del out
            held = live.live
            if backward:
                root.backward(None if y is not None else torch.ones_like(root))
    finally:
        for handle in drops:
            handle.remove()
    inputs = 0
    if x.requires_grad:  # once, if autograd saved it too
        keep(x)
        inputs = x.numel() * x.element_size()
    return StepBytes(sum(seen.values()), held + inputs, live.peak + inputs)


def plan_pipeline_stage(
    cfg, inp: zoo.InputSpec, model_layers, start: int, local, groups: ModelGroups,
    replicas: int, in_flight: int, threads=1, rank=0, gpu=False,
):  # fmt: skip
    """(the plan's terms, the baseline) of a rank of a pipeline stage before the stage
    exists, or None (a user's model; experts, whose routing a fake forward cannot run).

    The stage's layers (`local`: its part of model_layers[start:...], experts and
    tensor-parallel pieces its own) are a model trained over `replicas` at the
    configured ZeRO stage (0 or 1), exchange/memory_plan.plan_stage's terms; its
    activations are those of the `in_flight` micro-batches the schedule holds at once
    (schedule.peak_in_flight: GPipe m, 1F1B at most P - s), each with the stage's input
    and output; its gradients, accumulated over the micro-batches, add the largest
    parameter's (autograd's new gradient, before it is added to `.grad`). The input's
    shape comes from a fake forward of the layers before it."""
    model_cfg, t = cfg.model, cfg.train
    if not zoo.is_zoo_model(model_cfg["name"]) or zoo.has_moe(model_cfg):
        return None
    precision, last = t["precision"], start + len(local) == len(model_layers)
    with FakeTensorMode():
        x, y = _fake_batch(inp, t["batch_size"])
        if start:  # activations are whole between stages, on every tensor rank
            with torch.no_grad(), compute_precision(precision):
                x = ZooNet(model_layers[:start], fused_attention=gpu)(x).float()
            x.requires_grad_(True)
        net = ZooNet(local, groups, fused_attention=gpu)
        dense = list(net.parameters())
        shape = ModelShape(
            sizes=[p.numel() for p in dense],
            layers=module_params(net, dense),
            activation_bytes=_activation_bytes(
                net, x, y if last else None, precision, gpu, in_flight
            ),
        )
    prepare_process(threads, t["deterministic"], t["seed"] + rank)
    unit, bucket = int(t["zero_unit_mb"] * 2**20), int(t["bucket_mb"] * 2**20)
    terms = plan_stage(shape, replicas, t["zero"], cfg.optimizer, unit, bucket, "none", gpu)
    if cfg.pipeline["microbatches"] > 1:  # each later micro-batch's gradient, then added
        accumulating = 4.0 * max(shape.sizes, default=0)
        terms["gradients"] += accumulating
        terms["total"] += accumulating
    return terms, resident_baseline(cfg.optimizer)


def plan_stages(
    cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, stages, threads=1, rank=0, gpu=False
):
    """(ModelShape, {stage: the plan's terms}, this process's resident bytes before the
    model) for a zoo model on `n` data-parallel ranks, or None for a user's model.
    Prepares the process first (threads, seeds), as the backend will, so the baseline
    includes torch's thread pools."""
    t = cfg.train
    shape = plan_shape(cfg.model, inp, groups, t["batch_size"], t["seed"], t["precision"], gpu)
    if shape is None:
        return None
    prepare_process(threads, t["deterministic"], t["seed"] + rank)
    unit, bucket = int(t["zero_unit_mb"] * 2**20), int(t["bucket_mb"] * 2**20)
    plans = {
        s: plan_stage(shape, n, s, cfg.optimizer, unit, bucket, t["offload"], gpu) for s in stages
    }
    return shape, plans, resident_baseline(cfg.optimizer)


def plan_before_build(
    cfg, inp: zoo.InputSpec, groups: ModelGroups, n: int, threads: int, rank, gpu=False
):
    """(the plan's terms for the configured ZeRO stage, the baseline) or None for a
    user's model: what the limit check needs before anything of the model exists."""
    planned = plan_stages(cfg, inp, groups, n, (cfg.train["zero"],), threads, rank, gpu)
    if planned is None:
        return None
    _, plans, baseline = planned
    return plans[cfg.train["zero"]], baseline
