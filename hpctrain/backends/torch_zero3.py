"""ZeRO-3 for the torch backend: each rank keeps 1/N of every dense parameter.

The model's layers are grouped into units (exchange/zero.py `unit_plan`, sized by
`train.zero_unit_mb`); a unit's parameters are views into one of two persistent slots
(unit u in slot u % 2, each the largest unit's size): a forward pre-hook gathers the
unit into its slot (or waits for its prefetch) and starts the next unit's gather into
the other slot; a forward hook gives the slot up and puts a hook on the unit's output,
which fires when backward reaches the unit, gathers it again unless its slot still
holds it, and prefetches the unit before it. Each parameter's gradient is copied out by
a post-accumulate-grad hook into a reused gradient buffer; when a unit's last gradient
is in, its slot is given up and its gradient reduce-scattered (in a fixed order on
every rank, as stage 2). The optimizer holds one flat parameter, this rank's shard, and
steps on it alone; nothing is gathered after the step: the next forward gathers what it
uses.

Slots, not per-unit buffers freed and allocated again: a unit above glibc's 32 MiB mmap
threshold would come back from the kernel as fresh pages on every gather (faulted and
zeroed: measured, ZeRO-3 at 0.78x ZeRO-2's throughput on one node). Autograd saves
parameters and views of them during forward; they point into the slot, and the unit is
in its slot again before its backward reads them (units run in sequence: the unit that
shares the slot has finished its backward by then). MPI writes through a numpy view,
which does not bump autograd's version counters; a process group (gloo, nccl) writes
into the slot tensor, whose counter the parameters do not share (`param.data = view`
keeps a parameter's own). On a GPU, NCCL's stream waits for the compute queued before a
gather, so a slot is refilled only after the kernels that read it.

Activation checkpointing composes: a recomputed unit's forward (inside backward) finds
its parameters gathered and does not free them.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError
from ..exchange.zero import ZeroPartition, unit_plan
from ..exchange.zero3 import UnitGather, memory_figures
from .torch_hooks import weak_hook
from .torch_offload import shard_optimizer
from .torch_zero import ShardedOptimizerState


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The model's layers in forward order: a zoo model's sequence, or a user model's
    children in registration order."""
    return list(model.seq) if hasattr(model, "seq") else list(model.children())


def module_params(model: nn.Module, params: list[nn.Parameter]) -> list[list[int]]:
    """Indices (into `params`) of the parameters of each unit module; every parameter in
    exactly one module, or a ConfigError that says why ZeRO-3 cannot shard the model."""
    index = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    out = []
    for m, module in enumerate(unit_modules(model)):
        mine = []
        for p in module.parameters():
            i = index.get(id(p))
            if i is None:
                continue  # an expert: not partitioned
            if i in owner:
                raise ConfigError(
                    "train.zero=3 gathers parameters per layer; a parameter is shared by "
                    "two layers (tied weights): use train.zero=2"
                )
            owner[i] = m
            mine.append(i)
        out.append(sorted(mine))
    names = {id(p): n for n, p in model.named_parameters()}
    lost = [names[id(p)] for i, p in enumerate(params) if i not in owner]
    if lost:
        raise ConfigError(
            f"train.zero=3 gathers parameters per child module of the model; {lost[0]} is "
            "registered on the model itself: move it into a layer, or use train.zero=2"
        )
    return out


SLOTS = 2  # gathered units at once: the running one and the prefetched one


class TorchZero3(ShardedOptimizerState):
    def __init__(
        self,
        world,
        model: nn.Module,
        params: list[nn.Parameter],
        unit_bytes: int,
        make_opt,
        prefetch: bool = True,
        init=None,
        transport=None,
        device: torch.device | None = None,
        offload: str = "none",
    ):
        """`init`: (name, initial value) of every tensor of a model built lazily
        (torch_model.init_stream): each unit is filled, sharded and freed in turn, so a
        rank never holds more than one unit of the whole model. Without it the model's
        own parameters are taken, rank 0's broadcast. `transport`: the process-group
        transport of the gloo/nccl engines (shard, slots and gradients are tensors on
        `device`); None: the MPI engine over `world` (their numpy views, host memory).
        `offload`: train.offload (torch_offload.py: master and optimizer on the host)."""
        modules = unit_modules(model)
        per_layer = module_params(model, params)
        sizes = [p.numel() for p in params]
        groups = unit_plan(per_layer, sizes, unit_bytes)
        units = [sorted(i for m in g for i in per_layer[m]) for g in groups]
        self.part = part = ZeroPartition(transport or world, sizes, 3, 0, units=units, host=world)
        # the transport's view of a tensor: its numpy view (MPI, host memory) or itself
        self._arr = (lambda t: t.numpy()) if transport is None else (lambda t: t)
        self.params = params
        device = torch.device("cpu") if device is None else device
        # optimizer+params: the shard in pinned host memory, its pieces staged to gather
        on_host = offload == "optimizer+params"
        pin = on_host and device.type == "cuda"
        where = torch.device("cpu") if on_host else device
        self.shard = nn.Parameter(torch.zeros(part.shard_len, device=where, pin_memory=pin))
        self._shard_arr = self._arr(self.shard.detach())  # what the gathers send from
        # two persistent slots of the largest unit's size; unit u lives in slot u % 2
        self._largest = largest = max(seg.padded for seg in part.segments)
        self._staging = [  # a host shard's piece on the device, one per slot
            torch.empty(largest // part.n, device=device) for _ in range(SLOTS if on_host else 0)
        ]
        self._slots = [torch.zeros(largest, device=device) for _ in range(SLOTS)]
        self._full = [self._slots[u % SLOTS][: seg.padded] for u, seg in enumerate(part.segments)]
        with torch.no_grad():
            if init is None:
                self._take_params(world)
            else:
                self._fill(model, init)
        # Gloo and NCCL progress on their own threads and streams: no polling thread
        poll = {} if transport is None else {"poll_s": 0.0}
        staged = {"source": self._staged} if on_host else {}
        self.gather = UnitGather(
            part, self._shard_arr, self._buffer, SLOTS, prefetch, **poll, **staged
        )
        self._spare: list = []  # gradient buffers of the largest unit's size
        self.opt = shard_optimizer(offload, self.shard, make_opt, world)
        self.optimizer = self.opt.optimizer
        self._shard_grad = torch.zeros(part.shard_len, device=device)
        self.shard_grad = self._arr(self._shard_grad)  # the same memory, transport's type
        self.grad_bytes_peak = 0
        self.gathered_peak = SLOTS * largest * 4  # the slots hold the gathered units
        self._open: dict = {}  # unit -> its gradient buffer (largest-unit sized), filling
        self._order = list(reversed(range(len(part.segments))))  # backward's order
        self._in_backward = False
        self._live = False
        self._arm()
        for u, group in enumerate(groups):
            first, last = modules[group[0]], modules[group[-1]]
            first.register_forward_pre_hook(weak_hook(self._before_forward, u))
            last.register_forward_hook(weak_hook(self._after_forward, u))
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready, i))

    # --- construction: the shard from whole units, one unit at a time ------------------
    def _view(self, i: int) -> torch.Tensor:
        part = self.part
        seg = part.segments[part.segment_of[i]]
        at = part.offsets[i] - seg.start
        return self._full[part.segment_of[i]][at : at + part.sizes[i]].view_as(self.params[i])

    def _open_unit(self, u: int) -> torch.Tensor:
        return self._full[u].zero_()  # the padding stays zero

    def _close_unit(self, u: int) -> None:
        """This rank's piece of unit u into the shard (its slot is reused)."""
        part = self.part
        k = part.segments[u].piece(part.n)
        lo = part.rank * k
        part.shard_view(self._shard_arr, u)[:] = self._arr(self._full[u])[lo : lo + k]

    def _take_params(self, world) -> None:
        for u, seg in enumerate(self.part.segments):
            flat = self._open_unit(u)
            for i in seg.params:
                view = self._view(i)
                view.copy_(self.params[i].detach())
                self.params[i].data = view
            if world is not None and world.size > 1:  # rank 0's weights everywhere
                host = flat.cpu().numpy()  # construction only: through the host
                world.bcast_inplace(host, what=f"ZeRO-3 broadcast unit {u}")
                flat.copy_(torch.from_numpy(host))
            self._close_unit(u)

    def _fill(self, model: nn.Module, init) -> None:
        """Fill a lazily built model from `init` (canonical values, the same on every
        rank): dense parameters unit by unit into the shard, the rest in place."""
        part = self.part
        index = {n: i for i, (n, p) in enumerate(self._named(model))}
        others = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in index}
        left = [len(seg.params) for seg in part.segments]
        for key, value in init:
            i = index.get(key)
            if i is None:  # a buffer or an expert: allocated here if it was built lazily
                t = others.pop(key)
                if t.untyped_storage().nbytes() == 0:
                    t.data = torch.zeros(t.shape, device=t.device)
                t.copy_(torch.from_numpy(value))
                continue
            u = part.segment_of[i]
            if left[u] == len(part.segments[u].params):
                self._open_unit(u)
            view = self._view(i)
            view.copy_(torch.from_numpy(value).reshape(view.shape))
            self.params[i].data = view
            left[u] -= 1
            if left[u] == 0:
                self._close_unit(u)
        if any(left) or others:  # a zoo layer the canonical specs do not name: a bug
            raise RuntimeError(f"no initial value for {sorted(others)[:3] or 'a parameter'}")

    def _named(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        names = {id(p): n for n, p in model.named_parameters()}
        return [(names[id(p)], p) for p in self.params]

    # --- storage ----------------------------------------------------------------------
    def _buffer(self, u: int):
        return self._arr(self._full[u])

    def _staged(self, u: int, piece: torch.Tensor) -> torch.Tensor:
        """Unit u's piece of the host shard, copied to the device for its gather (on the
        current stream, which the collective waits for; the buffer is reused by unit
        u + 2, whose gather starts after u's has finished: UnitGather._start)."""
        stage = self._staging[u % SLOTS][: piece.numel()]
        stage.copy_(piece, non_blocking=True)
        return stage

    def _grad_buffer(self, u: int):
        """A gradient buffer of the largest unit's size, zeroed over unit u's length,
        from the spares (allocated once, on the transport's side)."""
        base = self._spare.pop() if self._spare else self.part.arrays.zeros(self._largest)
        base[: self.part.segments[u].padded] = 0.0
        return base

    # --- the hooks -----------------------------------------------------------------------
    def _before_forward(self, u: int, module, args) -> None:
        self.gather.need(u)
        if not self._in_backward:  # a recomputation inside backward: the next is done
            self.gather.prefetch(u + 1 if u + 1 < len(self._full) else None)

    def _after_forward(self, u: int, module, args, output) -> None:
        if self._in_backward:  # a recomputed unit (activation checkpointing)
            return
        training = torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
        if training:
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(partial(self._before_backward, u))
            if u == len(self._full) - 1:
                return  # backward starts here: keep it
        self.gather.release(u)

    def _before_backward(self, u: int, grad) -> None:
        self._in_backward = True
        self.gather.need(u)
        self.gather.prefetch(u - 1 if u > 0 else None)

    @torch.no_grad()
    def _grad_ready(self, index: int, param) -> None:
        if not self._live:
            return
        part = self.part
        u = part.segment_of[index]
        seg = part.segments[u]
        if u not in self._open:
            self._open[u] = self._grad_buffer(u)
        at = part.offsets[index] - seg.start
        self._open[u][at : at + part.sizes[index]] = self._arr(param.grad.detach().reshape(-1))
        held = len(self._open) * self._largest * 4 + param.grad.numel() * 4
        self.grad_bytes_peak = max(self.grad_bytes_peak, held + part.shard_len * 4)
        param.grad = None  # only the shard of the gradient outlives backward
        self._left[u] -= 1
        if self._left[u] == 0:
            self.gather.release(u)  # its backward is over
        self._reduce_finished()

    def _reduce_finished(self) -> None:
        while self._next < len(self._order) and self._left[self._order[self._next]] == 0:
            u = self._order[self._next]
            buf = self._open.pop(u, None)
            if buf is None:  # no gradient reached this unit: it contributes zeros
                buf = self._grad_buffer(u)
            self.part.reduce_segment(u, buf[: self.part.segments[u].padded], self.shard_grad)
            self._spare.append(buf)
            self._next += 1

    def _arm(self) -> None:
        self._left = [len(seg.params) for seg in self.part.segments]
        self._next = 0

    # --- a step (the same calls as TorchZero) ------------------------------------------
    def begin_step(self) -> None:
        self._shard_grad.zero_()
        self.grad_bytes_peak = self.part.shard_len * 4
        self.part.take_sent()  # an evaluation's gathers since the last step: not its traffic
        for p in self.params:
            p.grad = None
        self._arm()
        self._live = True

    def end_backward(self) -> None:
        """After each micro-batch's backward: parameters that got no gradient count as
        zeros; every unit is reduced, in the same order on every rank, and freed."""
        self._left = [0] * len(self._left)
        self._reduce_finished()
        self.gather.release_all()
        self._in_backward = False
        self._arm()

    def reduce(self) -> None:
        """Everything was reduced during backward (end_backward)."""
        self._live = False

    def clip(self, max_norm: float, split=None, extra_sq: float = 0.0) -> float:
        return self.part.clip(self.shard_grad, max_norm, split, extra_sq)

    def step(self) -> None:
        self.opt.step(self._shard_grad)
        self.gather.invalidate()  # the shard changed: every unit is gathered afresh

    def sync_shard(self) -> None:
        """Nothing to do: the shard is the parameters (ZeRO-1/2 re-read it from them)."""

    # --- the whole parameters, for state ---------------------------------------------
    def all_params(self) -> list[np.ndarray]:
        """Every dense parameter, whole, on every rank (collective, one unit at a time:
        Psi bytes of copies; checkpoints use `root_params` or `param_pieces`)."""
        out: list[np.ndarray | None] = [None] * len(self.params)
        for u, seg in enumerate(self.part.segments):
            was_live = self.gather.is_live(u)
            self.gather.need(u)
            for i in seg.params:
                out[i] = self.params[i].detach().to("cpu", copy=True).numpy()
            if not was_live:
                self.gather.release(u)
        return out

    def root_params(self) -> list[np.ndarray] | None:
        """Every dense parameter on rank 0 (None elsewhere): one gather of the shards."""
        shapes = [tuple(p.shape) for p in self.params]
        what = "ZeRO-3 checkpoint: gather parameters"
        return self.part.gather_arrays(self._host_shard(), shapes, what)

    def param_pieces(self, names: list[str]) -> dict:
        """This rank's own part of every `model/<name>` (no communication)."""
        shapes = [tuple(p.shape) for p in self.params]
        return self.part.owned_pieces(self._host_shard(), [f"model/{n}" for n in names], shapes)

    def _host_shard(self) -> np.ndarray:
        """The shard in host memory (its own memory on CPU, a copy from a GPU: a save)."""
        return self.shard.detach().cpu().numpy()

    def load_params(self, arrays: list[np.ndarray]) -> None:
        """The shard from whole parameters (every rank holds them: a load)."""
        self.gather.invalidate()
        with torch.no_grad():
            self.shard.copy_(torch.from_numpy(self.part.shard_of(self.part.flatten(arrays))))
        self.opt.refresh()

    # --- memory ----------------------------------------------------------------------------
    def memory(self, slots: int) -> dict[str, float]:
        opt = self.optimizer_bytes()
        figures = memory_figures(self.gather, self.gathered_peak, self.grad_bytes_peak, opt, slots)
        if self._staging:  # optimizer+params: the shard is host memory, its staging not
            staged = sum(s.numel() for s in self._staging) - self.part.shard_len
            figures["mem_param_bytes"] += 4.0 * staged
        return {**figures, "mem_offloaded_bytes": self.opt.host_bytes()}
