"""What the torch backend, the pipeline stage and the PS worker share: optimizers and
their canonical state, the rank's process settings, precision, evaluation, random
state and the backward of a step's micro-batches."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..moe.parallel import forget_jitter_rngs
from ..runtime.memory import current_rss_bytes
from .base import OPTIMIZER_SLOTS, EvalStats
from .torch_device import from_host, to_host


def host_scalar(value, dtype) -> np.ndarray:
    """A number or a one-element tensor (Adam's step count, on the GPU for fused Adam;
    fp16's loss scale) as a 0-d `dtype` array, read now (from a GPU: a host wait)."""
    return np.array(float(value)).astype(dtype)


def export_optimizer_state(
    optimizer, named_params, kind: str, host=to_host, scalar=host_scalar
) -> dict[str, np.ndarray]:
    """`optimizer/<slot>/<name>` (+ `optimizer/step` for Adam) in the canonical layout.

    torch creates slots at the first step; before it they are exported as zeros, which is
    what they would start from. host(tensor) -> ndarray takes each slot to the host: a
    copy by default; views of the live slots (valid until the next step) or a HostMirror's
    buffers are the torch backend's (torch_state.py); scalar(value, dtype) likewise
    takes Adam's step count (the last parameter's: all count alike).
    """
    state, step = {}, None
    for name, param in named_params:
        st = optimizer.state.get(param, {})
        for slot in OPTIMIZER_SLOTS[kind]:
            value = st.get(slot)
            state[f"optimizer/{slot}/{name}"] = (
                np.zeros(tuple(param.shape), np.float32) if value is None else host(value)
            )
        if "step" in st:
            step = st["step"]
    if kind == "adam":
        state["optimizer/step"] = scalar(0 if step is None else step, np.int64)
    return state


def import_optimizer_state(optimizer, named_params, kind: str, state: dict) -> None:
    """The inverse of `export_optimizer_state` (ValueError naming a missing slot)."""
    step = int(state.get("optimizer/step", 0))
    for name, param in named_params:
        st = optimizer.state[param]
        for slot in OPTIMIZER_SLOTS[kind]:
            key = f"optimizer/{slot}/{name}"
            if key not in state:
                raise ValueError(f"optimizer state {key} missing")
            st[slot] = from_host(state[key], param)
        if kind == "adam":
            st["step"] = adam_step(optimizer, param, step)


def adam_step(optimizer, param, step: int) -> torch.Tensor:
    """Adam's step count as torch keeps it: on the parameter's device for the fused and
    capturable kernels, which read it there (torch's own load_state_dict moves it so; a
    host count beside CUDA parameters is not theirs), on the host otherwise."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    device = param.device if on_device else torch.device("cpu")
    return torch.tensor(float(step), dtype=torch.float32, device=device)


def make_optimizer(ocfg: dict, params: list) -> torch.optim.Optimizer:
    """torch's SGD or Adam over `params` as the optimizer section says; Adam is torch's
    fused implementation (one kernel for every tensor), on every device.

    Measured: on an H100 (472 M parameters) the foreach update took 24% of the step; on
    one CPU thread of this VM a 25 M-element update takes 13 ms fused against 114 ms
    for torch's CPU default (one tensor at a time), and the 50 M-parameter transformer's
    whole step 254 against 350 ms. The same math to float32 rounding.

    SGD is fused where its parameters are on a GPU: fp16's loss scaler then hands the
    overflow flag to the kernel, which skips the update on the device, instead of
    reading the flag on the host every step (torch's GradScaler does for other
    optimizers). On CPU it keeps torch's default, so CPU results stay as they were."""
    if ocfg["name"] == "sgd":
        return make_sgd(ocfg, params, fused=any(p.is_cuda for p in params))
    return torch.optim.Adam(
        params,
        lr=ocfg["lr"],
        betas=tuple(ocfg["betas"]),
        eps=ocfg["eps"],
        weight_decay=ocfg["weight_decay"],
        fused=True,
    )


def make_sgd(ocfg: dict, params: list, fused: bool) -> torch.optim.SGD:
    """torch's SGD; fused with momentum, its buffers made as zeros now.

    Why: torch's fused SGD makes them at its first step with `empty_like` and fills them
    from the gradients inside the kernel, which fp16's loss scaler skips when that step
    overflowed: uninitialised memory then becomes the momentum (NaN where
    `train.deterministic` fills fresh memory with NaN). From zeros the first update is
    the same to the bit (0.9 x 0 + g = g), and a checkpoint taken before the first step
    already exports zeros (`export_optimizer_state`)."""
    opt = torch.optim.SGD(
        params,
        lr=ocfg["lr"],
        momentum=ocfg["momentum"],
        weight_decay=ocfg["weight_decay"],
        fused=fused or None,
    )
    if fused and ocfg["momentum"]:
        for p in params:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


# --- what the backend, the pipeline stage and the PS worker share ------------------------
def prepare_process(threads: int, deterministic: bool, seed: int) -> None:
    """Threads, deterministic kernels and every random stream of this rank's process."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(bool(deterministic))  # not left on by an earlier run
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    forget_jitter_rngs()  # MoE layers' noise streams: made afresh by this run's layers


def compute_precision(precision, device_type: str = "cpu"):
    """torch's autocast on the rank's device for `precision` (`train.precision`, or True
    for bf16): matmuls, convolutions and what follows them in bfloat16 or float16;
    parameters, gradients and optimizer state stay float32."""
    dtype = {True: torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def make_loss_scaler(precision: str, device_type: str):
    """fp16: dynamic loss scaling (torch's GradScaler); None otherwise. The scaler unscales
    after the gradient average, so an overflow on any rank (inf or NaN in its gradient
    makes the averaged gradient inf/NaN on every rank) skips the step on every rank."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type)


def scaler_state(scaler, scalar=host_scalar) -> dict[str, np.ndarray]:
    """The loss scale and its growth counter, for checkpoints (empty without fp16).
    scalar(value, dtype) takes each to the host (see export_optimizer_state): the
    scaler's own tensors once it has scaled a step (torch keeps them on the GPU there),
    its state_dict's numbers before."""
    if scaler is None:
        return {}
    scale = getattr(scaler, "_scale", None)
    growth = getattr(scaler, "_growth_tracker", None)
    if scale is None or growth is None:
        st = scaler.state_dict()
        scale, growth = st.get("scale", 2.0**16), st.get("_growth_tracker", 0)
    return {
        "optimizer/loss_scale": scalar(scale, np.float64),
        "optimizer/loss_scale_growth": scalar(growth, np.int64),
    }


def load_scaler_state(scaler, state: dict) -> None:
    """Restore what scaler_state saved (a checkpoint without it starts a fresh scale)."""
    if scaler is None or "optimizer/loss_scale" not in state:
        return
    st = scaler.state_dict()
    st["scale"] = float(state["optimizer/loss_scale"])
    st["_growth_tracker"] = int(state.get("optimizer/loss_scale_growth", 0))
    scaler.load_state_dict(st)


@torch.no_grad()
def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray, bf16=False) -> EvalStats:
    """Summed loss, correct predictions and count of one batch in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    with compute_precision(bf16, device.type):
        logits = model(torch.from_numpy(x).to(device))
    logits = logits.float()
    yt = torch.from_numpy(y).to(device)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yt.reshape(-1), reduction="sum")
    return EvalStats(float(loss), int((logits.argmax(-1) == yt).sum()), int(np.prod(y.shape)))


def rng_state() -> dict[str, np.ndarray]:
    """torch's global generators (dropout and other random layers draw from them): the
    CPU's, and the current GPU's on a GPU rank (ignored when resumed on a CPU rank)."""
    state = {"torch": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state().numpy().copy()
    return state


def set_rng_state(state: dict[str, np.ndarray]) -> None:
    if "torch" in state:
        torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))
    if "torch_cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(torch.from_numpy(np.asarray(state["torch_cuda"], np.uint8)))


def resident_baseline(optimizer_cfg: dict) -> int:
    """This process's resident bytes before any model tensor, once the code a step
    loads is loaded: torch's optimizers import ~70 MiB of modules at their first
    construction, which is no model's memory (the memory plan's baseline)."""
    make_optimizer(optimizer_cfg, [nn.Parameter(torch.zeros(1))])
    return current_rss_bytes()


def backward_mean_loss(
    model: nn.Module,
    micro_batches,
    aux_loss=None,
    before_last=None,
    after_each=None,
    bf16=False,
    feed=None,
    scaler=None,
    tally=True,
    keep_sums=None,
) -> tuple[float, int, int]:
    """Backward of the mean loss over all the step's samples on this rank (gradients
    accumulate over the micro-batches); returns (loss sum, correct, count).
    `aux_loss(model)`: an extra per-token loss of the last forward (MoE balancing).
    `before_last()`: called before the last micro-batch's backward (the overlapped
    engine starts communication only there, when the gradients become final).
    `after_each()`: called after each micro-batch's backward (ZeRO-2 reduces there).
    `bf16`: the precision (`train.precision`, or a bool for bf16). `scaler`: fp16's
    loss scaler, which scales each micro-batch's loss before its backward.
    `feed(array)`: numpy to the model's device (a DeviceFeeder's `put`). On a GPU rank
    (or with `keep_sums=True`: the backend's step, on every device, read after it by
    torch_device.read_later) the loss and correct counts stay 0-d tensors (float64,
    int64): reading them would synchronise the host, so they are read after the step.
    `tally=False`: no argmax (~1% of a GPU step), correct is NaN: the loop reads
    the accuracy of the steps it logs only."""
    feed = feed or torch.from_numpy
    total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
    loss_sum, correct = 0.0, 0
    for i, (x, y) in enumerate(micro_batches):
        if before_last is not None and i == len(micro_batches) - 1:
            before_last()
        xt, yt = feed(x), feed(y)
        keep = xt.device.type != "cpu" if keep_sums is None else keep_sums
        with compute_precision(bf16, xt.device.type):
            raw = model(xt)
        logits = raw.float()  # the loss in float32 (as autocast does)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), yt.reshape(-1), reduction="sum"
        )
        aux = aux_loss(model) if aux_loss is not None else None
        term = loss if aux is None else loss + aux * yt.numel()
        term = term / total
        # the same index as over the float32 copy (an exact widening), half the bytes read
        hits = (raw.detach().argmax(-1) == yt).sum() if tally else 0
        # not held through backward: at bf16 the logits and their float32 copy are 6
        # bytes per token and vocabulary entry (benchmarks/gpu_bench.py's transformer:
        # 16 x 1,024 tokens x 16,384 entries, 1.5 GiB beside its 9.9 GiB GPU peak)
        del raw, logits
        (term if scaler is None else scaler.scale(term)).backward()
        if after_each is not None:
            after_each()
        if keep:  # no host synchronisation inside the step
            loss_sum = loss_sum + loss.detach().double()
            correct = correct + hits
        else:
            loss_sum += float(loss.detach())
            correct += int(hits)
    return loss_sum, correct if tally else float("nan"), total
