"""ZeRO-1/2 for the torch backend (the layout and the collectives: exchange/zero.py).

The partition runs over a transport (exchange/transport.py): on the `mpi` engine the
World (host numpy buffers, which here are views of the torch tensors' memory: no
copy); on the process-group engines (`gloo`, `nccl`) a `ProcessGroupTransport`, whose
buffers are the torch tensors themselves, on the rank's device, so a step's shard,
gradients, reduce-scatters and allgathers never leave it. Checkpoints gather the
optimizer state over MPI on the host (once per save).

The dense parameters become views of one padded flat tensor, so the allgather of the
updated shards writes straight into the model; the torch optimizer holds one flat
parameter, this rank's shard, and so only the shard's state (SGD and Adam are
elementwise: the update equals the per-parameter one).

Stage 1: `.grad` of every parameter is a view of one flat gradient tensor (accumulation
adds into it), reduce-scattered after backward. Stage 2: a post-accumulate-grad hook
copies each gradient into its segment's buffer and frees it (`param.grad = None`); a
finished segment is reduce-scattered at once, in a fixed order on every rank, and its
buffer dropped, so a rank never holds more than its shard, the open segments and the
gradient being produced.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..exchange.zero import ZeroPartition
from .base import OPTIMIZER_SLOTS
from .torch_hooks import weak_hook
from .torch_offload import shard_optimizer, slot_bytes
from .torch_steps import adam_step


class ShardedOptimizerState:
    """The optimizer state of a ZeRO shard in the canonical layout, for TorchZero and
    TorchZero3: needs self.part, self.params, self.optimizer and self.opt (a shard
    optimizer of torch_offload.py, whose parameter keys the state)."""

    def export_optimizer(self, names: list[str], kind: str) -> dict[str, np.ndarray]:
        """`optimizer/<slot>/<name>` for every dense parameter, on rank 0 (collective)."""
        state = {}
        for slot in OPTIMIZER_SLOTS[kind]:
            full = self.part.gather_full(self._slot_shard(slot), f"ZeRO checkpoint: gather {slot}")
            if full is None:
                continue
            for name, p, view in zip(names, self.params, self.part.views(full), strict=True):
                state[f"optimizer/{slot}/{name}"] = view.reshape(tuple(p.shape)).copy()
        return {**state, **self.step_state(kind)}

    def _slot_shard(self, slot: str) -> np.ndarray:
        """This rank's shard of an optimizer slot on the host (zeros before the first
        step)."""
        value = self.optimizer.state.get(self.opt.param, {}).get(slot)
        if value is None:
            return np.zeros(self.part.shard_len, np.float32)
        return value.detach().cpu().numpy()

    def step_state(self, kind: str) -> dict[str, np.ndarray]:
        """`optimizer/step` (Adam's step count, the same on every rank), or nothing."""
        if kind != "adam":
            return {}
        st = self.optimizer.state.get(self.opt.param, {})
        return {"optimizer/step": np.array(int(float(st.get("step", 0))), dtype=np.int64)}

    def optimizer_pieces(self, names: list[str], kind: str) -> dict:
        """This rank's own part of every `optimizer/<slot>/<name>` (no communication):
        what a sharded checkpoint writes from this rank."""
        shapes = [tuple(p.shape) for p in self.params]
        pieces = {}
        for slot in OPTIMIZER_SLOTS[kind]:
            keys = [f"optimizer/{slot}/{n}" for n in names]
            pieces.update(self.part.owned_pieces(self._slot_shard(slot), keys, shapes))
        return pieces

    def import_optimizer(self, names: list[str], kind: str, state: dict) -> None:
        st = self.optimizer.state[self.opt.param]
        for slot in OPTIMIZER_SLOTS[kind]:
            keys = [f"optimizer/{slot}/{n}" for n in names]
            missing = [k for k in keys if k not in state]
            if missing:
                raise ValueError(f"optimizer state {missing[0]} missing")
            full = self.part.flatten([state[k] for k in keys])
            st[slot] = torch.from_numpy(self.part.shard_of(full)).to(self.opt.param.device)
        if kind == "adam":
            st["step"] = adam_step(
                self.optimizer, self.opt.param, int(state.get("optimizer/step", 0))
            )

    def optimizer_bytes(self) -> float:
        return slot_bytes(self.optimizer, self.opt.param)


class TorchZero(ShardedOptimizerState):
    def __init__(
        self,
        world,
        params: list[nn.Parameter],
        stage: int,
        bucket_bytes: int,
        make_opt,
        transport=None,
        offload: str = "none",
    ):
        """`transport`: the process-group transport of the gloo/nccl engines (torch
        tensors on the parameters' device); None: the MPI engine over `world` (numpy).
        `offload`: train.offload (torch_offload.py)."""
        sizes = [p.numel() for p in params]
        self.part = part = ZeroPartition(transport or world, sizes, stage, bucket_bytes, host=world)
        # the transport's view of a tensor: its numpy view (MPI, host memory) or itself
        self._arr = (lambda t: t.numpy()) if transport is None else (lambda t: t)
        self.params = params
        # the transport's device (the parameters'), also for a pipeline stage without
        # parameters, whose empty shard still joins the exchange (NCCL takes no host
        # tensors); the MPI engine's numpy views are host memory
        device = transport.device if transport is not None else torch.device("cpu")
        self.flat = torch.zeros(part.flat_len, device=device)
        with torch.no_grad():
            for p, v in zip(params, part.views(self.flat), strict=True):
                v = v.view_as(p)
                v.copy_(p.detach())
                p.data = v
        self.shard = nn.Parameter(torch.zeros(part.shard_len, device=device))
        with torch.no_grad():
            part.shard_of(self.flat, out=self.shard.detach())
        self.opt = shard_optimizer(offload, self.shard, make_opt, world)
        self.optimizer = self.opt.optimizer
        self._shard_grad = torch.zeros(part.shard_len, device=device)
        self.shard_grad = self._arr(self._shard_grad)  # the same memory, transport's type
        self.grad_bytes_peak = 0
        if stage == 1:
            self.grads = torch.zeros(part.flat_len, device=device)
            self._grad_views = [
                v.view_as(p) for p, v in zip(params, part.views(self.grads), strict=True)
            ]
        else:
            self._live = False
            self._open: dict[int, object] = {}  # segment -> buffer, while it fills
            self._order = list(reversed(range(len(part.segments))))  # backward's order
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready, i))

    # --- a step -----------------------------------------------------------------------
    def begin_step(self) -> None:
        self._shard_grad.zero_()
        self.grad_bytes_peak = self.part.shard_len * 4
        if self.part.stage == 1:
            self.grads.zero_()
            for p, view in zip(self.params, self._grad_views, strict=True):
                p.grad = view  # backward accumulates into the flat tensor
            self.grad_bytes_peak += self.grads.numel() * 4
        else:
            for p in self.params:
                p.grad = None
            self._begin_backward()

    def _begin_backward(self) -> None:
        self._left = [len(seg.params) for seg in self.part.segments]
        self._next = 0
        self._live = True

    @torch.no_grad()
    def _grad_ready(self, index: int, param) -> None:
        if not self._live:
            return
        part = self.part
        s = part.segment_of[index]
        seg = part.segments[s]
        grad = self._arr(param.grad.detach().reshape(-1))
        if len(seg.params) == 1 and seg.padded == seg.length:
            self._open[s] = grad  # a segment of one unpadded gradient: no copy
            fresh = 0
        else:
            if s not in self._open:
                self._open[s] = part.arrays.zeros(seg.padded)
            at = part.offsets[index] - seg.start
            self._open[s][at : at + part.sizes[index]] = grad
            fresh = part.sizes[index] * 4  # the gradient and its copy, until dropped below
        held = sum(len(b) for b in self._open.values()) * 4 + fresh
        self.grad_bytes_peak = max(self.grad_bytes_peak, held + part.shard_len * 4)
        param.grad = None  # stage 2: only the shard of the gradient outlives backward
        self._left[s] -= 1
        self._reduce_finished()

    def _reduce_finished(self) -> None:
        while self._next < len(self._order) and self._left[self._order[self._next]] == 0:
            s = self._order[self._next]
            buf = self._open.pop(s, None)
            if buf is None:  # no gradient reached this segment: it contributes zeros
                buf = self.part.arrays.zeros(self.part.segments[s].padded)
            self.part.reduce_segment(s, buf, self.shard_grad)
            self._next += 1

    def end_backward(self) -> None:
        """After each micro-batch's backward (stage 2): parameters that got no gradient
        count as zeros; every segment is reduced, in the same order on every rank."""
        if self.part.stage != 2:
            return
        self._left = [0] * len(self._left)
        self._reduce_finished()
        self._live = False
        self._begin_backward()

    def reduce(self) -> None:
        """Stage 1: reduce-scatter the flat gradient after backward."""
        self._live = False
        if self.part.stage == 1:
            flat = self._arr(self.grads)
            for p, view in zip(self.params, self._grad_views, strict=True):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)  # autograd replaced the view: take its gradient
            self.part.reduce_all(flat, self.shard_grad)

    def clip(self, max_norm: float, split=None, extra_sq: float = 0.0) -> float:
        """torch's clip_grad_norm_ rule on the whole gradient, from the shards (`split`:
        tensor parallelism, see ZeroPartition.global_norm; `extra_sq`: the squares of
        gradients outside the partition, MoE experts). Returns the coefficient."""
        return self.part.clip(self.shard_grad, max_norm, split, extra_sq)

    def step(self) -> None:
        self.opt.step(self._shard_grad)
        with torch.no_grad():
            self.part.gather_params(self._arr(self.shard.detach()), self._arr(self.flat))
        if self.part.stage == 2:
            for p in self.params:
                p.grad = None

    def sync_shard(self) -> None:
        """The shard from the (replicated) parameters: after a broadcast or a load."""
        with torch.no_grad():
            self.part.shard_of(self.flat, out=self.shard.detach())
        self.opt.refresh()  # an offloaded master follows

    # --- memory -------------------------------------------------------------------------
    def memory(self, slots: int) -> dict[str, float]:
        return {
            "mem_param_bytes": float(self.flat.numel() * 4),
            "mem_grad_bytes": float(self.grad_bytes_peak),
            "mem_optimizer_bytes": self.optimizer_bytes(),
            "mem_offloaded_bytes": self.opt.host_bytes(),
            **self.part.expected_bytes(slots),
        }


def make_torch_zero(cfg, world, params: list, transport, make_opt) -> TorchZero:
    """ZeRO-1/2 over the World (host numpy, the `mpi` engine; `transport` None) or over
    the process-group engine's `transport` on the parameters' device (`gloo` on CPU
    ranks, `nccl` on GPU ranks: backends/torch_transport.py)."""
    bucket_bytes = int(cfg.train["bucket_mb"] * 2**20)
    stage, offload = cfg.train["zero"], cfg.train["offload"]
    return TorchZero(world, params, stage, bucket_bytes, make_opt, transport, offload)
