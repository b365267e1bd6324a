"""The torch backend's state and memory: canonical weights and optimizer state in and
out (views on CPU, host copies from a GPU), and the per-rank memory figures (the
CUDA allocator's peaks on a GPU rank)."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
import torch

from ..runtime.memory import peak_rss_bytes
from .base import OPTIMIZER_SLOTS, model_part, replicated_memory_plan, with_model_prefix
from .torch_device import memory_figures, to_host
from .torch_mirror import HostMirror
from .torch_steps import (
    export_optimizer_state,
    host_scalar,
    import_optimizer_state,
    load_scaler_state,
    rng_state,
    scaler_state,
    set_rng_state,
)


def state_memory_plan(params, zero, flat, optimizer_name: str, opt_now: float) -> dict:
    """Bytes of gradients and optimizer state a rank will hold once training runs
    (`grad`, `optimizer`) and how much of them is resident now (`*_now`: torch
    allocates optimizer state at the first step; numpy buffers fill at first use), for
    `params` under `zero` (a TorchZero or None) with the engine's `flat` buffer."""
    slots = len(OPTIMIZER_SLOTS[optimizer_name])
    if zero is not None:
        e = zero.part.expected_bytes(slots)
        return {
            "grad": e["zero_model_grad_bytes"] + zero.part.largest_segment_bytes(),
            "grad_now": float(zero.part.flat_len * 4 if zero.part.stage == 1 else 0),
            "optimizer": e["zero_model_optimizer_bytes"],
            "optimizer_now": opt_now,
        }
    trainable = sum(p.numel() * 4 for p in params if p.requires_grad)
    return replicated_memory_plan(trainable, flat, slots, opt_now)


def optimizer_state_bytes(optimizer) -> float:
    """Bytes of a torch optimizer's state tensors (none before its first step but fused
    SGD's momentum: torch_steps.make_sgd)."""
    return float(
        sum(
            v.numel() * v.element_size()
            for st in optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    )


def _view(tensor: torch.Tensor) -> np.ndarray:
    """A view of a CPU tensor, a host copy of a GPU one (to_host without copying)."""
    return to_host(tensor, copy=False)


class TorchStateMixin:
    """For TorchBackend: needs self.model, self.optimizer, self.zero, self._names,
    self._dense, self._flat, self.device, self.scaler, self.cfg, self._fence and
    self._mirror (None until set here)."""

    def memory_plan(self) -> dict[str, float]:
        """state_memory_plan of this rank's model."""
        opt_now = self.memory()["mem_optimizer_bytes"]
        name = self.cfg.optimizer["name"]
        return state_memory_plan(self.model.parameters(), self.zero, self._flat, name, opt_now)

    def memory(self, grads=None) -> dict[str, float]:
        """Per-rank bytes of parameters, gradients and optimizer state, and peak RSS
        (`grads`: the step's handle, unused: torch's gradients are in param.grad)."""
        slots = len(OPTIMIZER_SLOTS[self.cfg.optimizer["name"]])
        if self.zero is not None:
            out = self.zero.memory(slots)
        else:
            grads = sum(p.grad.numel() * 4 for p in self.model.parameters() if p.grad is not None)
            buffer = getattr(self._flat, "buffer", None)
            opt = optimizer_state_bytes(self.optimizer)
            out = {
                "mem_param_bytes": float(sum(p.numel() * 4 for p in self.model.parameters())),
                "mem_grad_bytes": float(grads + (buffer.nbytes if buffer is not None else 0)),
                "mem_optimizer_bytes": float(opt),
            }
        out["mem_peak_rss_bytes"] = float(peak_rss_bytes())
        out["mem_rss_before_model_bytes"] = float(self.rss_before_model)
        out.update(memory_figures(self.device))  # the CUDA allocator's peaks on a GPU rank
        return out

    # --- state ------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self._names.values())

    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v.copy()) for k, v in self._live_weights().items())

    def _live_weights(self) -> OrderedDict[str, np.ndarray]:
        """Views of the model's parameters and buffers (valid until the next step);
        under ZeRO-3 the dense parameters are gathered (collective, copies)."""
        views = self._unsharded_weights()
        return self._in_model_order(views, self.zero.all_params()) if self._sharded else views

    @property
    def _sharded(self) -> frozenset:
        """The parameters ZeRO-3 keeps as shards only (none without ZeRO-3)."""
        if self.zero is None or self.zero.part.stage != 3:
            return frozenset()
        return frozenset(self.dense_names())

    def weight_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.check_weights(weights, self.weight_shapes())
        self._release_exported()
        sharded = self._sharded
        with torch.no_grad():
            for key, tensor in self.model.state_dict(keep_vars=True).items():
                if key not in sharded:
                    tensor.copy_(torch.from_numpy(np.asarray(weights[key], dtype=np.float32)))
        if sharded:
            self.zero.load_params([weights[n] for n in self.dense_names()])
        if self.zero is not None:
            self.zero.sync_shard()

    def export_state(self, staged: bool = False) -> dict[str, np.ndarray]:
        """The canonical state; under ZeRO a collective whose result is whole on rank 0.
        Valid until the next step (without ZeRO, views of the live tensors on a CPU
        rank, host copies from a GPU). staged=True (an async save's; without ZeRO): a
        GPU rank's arrays are a HostMirror's pinned buffers, still being filled beside
        the next step; read them only after `wait_exported()`."""
        if self.zero is not None:
            names = [self._names[p] for p in self._dense]
            kind = self.cfg.optimizer["name"]
            return {
                **with_model_prefix(self._root_weights()),
                **export_optimizer_state(self.optimizer, self._expert_named(), kind),
                **self.zero.export_optimizer(names, kind),
            }
        # CPU: views of the live tensors, no copy (a checkpoint writes them before the
        # next step, or an async save copies them into its reused buffers: staging.py).
        # GPU: host copies, or (staged) the HostMirror's, made beside the next step.
        with self._exporter(staged) as (host, scalar):
            names = ((n, p) for p, n in self._names.items())
            weights = self.model.state_dict().items()
            kind = self.cfg.optimizer["name"]
            return {
                **with_model_prefix(OrderedDict((k, host(v)) for k, v in weights)),
                **export_optimizer_state(self.optimizer, names, kind, host, scalar),
                **scaler_state(self.scaler, scalar),  # fp16's loss scale (ZeRO refuses fp16)
            }

    def _exporter(self, staged: bool):
        """A context giving (host(tensor) -> ndarray, scalar(value, dtype) -> 0-d
        array): a GPU rank's staged export copies into the HostMirror (made at the
        first), anything else takes to_host's views and reads one-element values now."""
        if not (staged and self.device.type == "cuda"):
            return nullcontext((_view, host_scalar))
        if self._mirror is None:
            self._mirror = HostMirror(self.device)
        return self._mirror.copying()

    def wait_exported(self) -> None:
        """Block the calling thread until a staged export's arrays hold their values."""
        if self._mirror is not None:
            self._mirror.ready()

    def hold_exported_state(self, fence) -> bool:
        """An async checkpoint copies export_state's views while the next step runs:
        `fence()` (the copy's end) is awaited before anything here changes them, i.e.
        the next optimizer update, a forward that updates buffers, set_weights,
        import_state and average_buffers. A GPU rank exports host copies (or, staged,
        its HostMirror's buffers, which only its next staged export rewrites), so there
        is no view to hold and the host never waits for the fence."""
        if self.device.type == "cpu":
            self._fence = fence
        return True

    def _release_exported(self) -> None:
        """Before the exported tensors change: a staged GPU export's copies are ordered
        first on the device; a CPU export's views wait for the async save's copy."""
        if self._mirror is not None:
            self._mirror.release()
        fence, self._fence = self._fence, None
        if fence is not None:
            fence()

    def export_owned_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Under ZeRO: (the replicated canonical state, {name: (shape, start, elements)}
        this rank alone holds, its optimizer shard), so a sharded checkpoint needs no
        communication."""
        names = [self._names[p] for p in self._dense]
        kind = self.cfg.optimizer["name"]
        sharded = self._sharded  # ZeRO-3: each rank writes its own parameter ranges
        weights = self._unsharded_weights()
        replicated = {
            **with_model_prefix(OrderedDict((k, v.copy()) for k, v in weights.items())),
            **export_optimizer_state(self.optimizer, self._expert_named(), kind),
            **self.zero.step_state(kind),
        }
        pieces = self.zero.optimizer_pieces(names, kind)
        if sharded:
            pieces.update(self.zero.param_pieces(names))
        return replicated, pieces

    def _unsharded_weights(self) -> OrderedDict[str, np.ndarray]:
        """Views of the tensors this rank holds whole: all of them, or under ZeRO-3
        the buffers and experts."""
        sharded = self._sharded
        state = self.model.state_dict().items()
        return OrderedDict((k, _view(v)) for k, v in state if k not in sharded)

    def _root_weights(self) -> OrderedDict[str, np.ndarray]:
        """The weights for a checkpoint whose result is whole on rank 0: ZeRO-3 gathers
        its shards to rank 0 only (one Gatherv), never onto every rank."""
        if not self._sharded:
            return self.get_weights()
        out = OrderedDict((k, v.copy()) for k, v in self._unsharded_weights().items())
        full = self.zero.root_params()
        if full is None:
            return out  # not rank 0 (of the data ranks): its result is not saved
        return self._in_model_order(out, full)

    def _in_model_order(self, unsharded: dict, dense: list) -> OrderedDict[str, np.ndarray]:
        """ZeRO-3's whole dense parameters (`dense`, in dense_names' order) among the
        unsharded tensors, in the model's order, as every other export."""
        gathered = dict(zip(self.dense_names(), dense, strict=True))
        return OrderedDict(
            (k, unsharded[k] if k in unsharded else gathered[k]) for k in self.model.state_dict()
        )

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        self.set_weights(model_part(state))  # waits for an async save's copy first
        if self.zero is not None:
            names = [self._names[p] for p in self._dense]
            kind = self.cfg.optimizer["name"]
            if self._expert_named():
                import_optimizer_state(self.optimizer, self._expert_named(), kind, state)
            self.zero.import_optimizer(names, kind, state)
            return
        names = ((n, p) for p, n in self._names.items())
        import_optimizer_state(self.optimizer, names, self.cfg.optimizer["name"], state)
        load_scaler_state(self.scaler, state)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)
