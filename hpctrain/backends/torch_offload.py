"""Who updates a ZeRO shard: the device's optimizer, or the host's (`train.offload`).

`train.offload: optimizer` is for GPU ranks whose memory is the limit. The float32
master copy of the rank's shard and the optimizer's state (Adam: two slots) live in
pinned host memory, and the CPU updates them. The device keeps the shard's working copy,
which the gathers send from, and the gradient shard, which the reduce-scatters fill.

Device memory per rank, in bytes, for Psi parameters over N ranks:
- ZeRO-1/2/3 with Adam: 16 Psi/N of shard state (shard, gradient shard, two slots)
  becomes 8 Psi/N (the shard's working copy and the gradient shard), beside ZeRO-1/2's
  whole parameters and ZeRO-3's gathered units.
The host holds 16 Psi/N: master, gradient copy, two slots.

`train.offload: optimizer+params` (ZeRO-3 only) keeps the shard itself in pinned host
memory: it is the master, the CPU updates it in place, and each gather copies the
unit's piece to the device first (Psi/N elements a pass, into one of two staging
buffers of the largest piece). The device keeps the gradient shard, the staging
buffers and the two gathered units: 4 Psi/N + 2 units + 2 pieces with Adam, against
8 Psi/N + 2 units with `optimizer`. ZeRO-1/2 keep whole parameters on the device, so
there is nothing more to move there.

Per step and rank: one copy of the gradient shard to the host (4 Psi/N bytes), the
CPU's update, and one copy of the updated shard back (4 Psi/N; with `optimizer+params`
none, but every gather's piece crosses to the device: 4 Psi/N per forward and per
backward). This shrinks with N; it
is the same whether N is 1,024 or 4,096. The host waits for the gradient shard (one
synchronisation, at the update), so the update is on the step's critical path and is
not hidden behind the next forward: hiding it would apply each update one step late,
which is not the single-process math.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.comm import under_deadline


class DeviceShardOptimizer:
    """The optimizer over the shard where it lives (no offload)."""

    def __init__(self, shard: nn.Parameter, make_opt):
        self.param = shard  # the parameter the optimizer holds (its state's key)
        self.optimizer = make_opt([shard])

    def step(self, grad: torch.Tensor) -> None:
        self.param.grad = grad
        self.optimizer.step()

    def refresh(self) -> None:
        """Nothing to do: the shard is the master copy."""

    def host_bytes(self) -> float:
        return 0.0


class HostShardOptimizer:
    """The master shard and the optimizer in (pinned) host memory, updated by the CPU;
    `shard` on the device is the working copy, rewritten after every update."""

    def __init__(self, shard: torch.Tensor, make_opt, comm=None):
        """comm: the shard's communicator, whose deadline the gradient's wait is under."""
        pin = shard.is_cuda  # pinned memory needs a GPU; a CPU shard's copies are plain
        self.comm = comm
        self.shard = shard
        self.param = nn.Parameter(torch.empty(shard.shape, pin_memory=pin))
        self._grad = torch.empty(shard.shape, pin_memory=pin)
        self.refresh()
        # the update is on the step's critical path: torch's fused CPU Adam, as every
        # rank's (torch_steps.make_optimizer)
        self.optimizer = make_opt([self.param])

    def refresh(self) -> None:
        """The master from the device's shard (after a load or a broadcast)."""
        with torch.no_grad():
            self.param.copy_(self.shard.detach())

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self._grad.copy_(grad, non_blocking=True)
        if grad.is_cuda:  # the CPU reads the gradient: wait for its copy (only this),
            # queued behind the step's collectives: a stalled peer is named here
            with under_deadline(self.comm, "the offloaded optimizer's gradient"):
                torch.cuda.current_stream(grad.device).synchronize()
        self.param.grad = self._grad
        self.optimizer.step()
        self._write_back()

    def _write_back(self) -> None:
        # stream-ordered: the next step's gradient copy, which the host waits for above,
        # comes after this one, so the master is not rewritten while it is being read
        self.shard.copy_(self.param.detach(), non_blocking=True)

    def host_bytes(self) -> float:
        """Master, gradient copy and the optimizer's slots."""
        return float(self.param.numel() * 8) + slot_bytes(self.optimizer, self.param)


class HostParamsOptimizer(HostShardOptimizer):
    """`optimizer+params`: the shard is in (pinned) host memory and is the master; the
    CPU updates it in place and nothing is copied back (the gathers read it)."""

    def __init__(self, shard: torch.Tensor, make_opt, comm=None):
        self.comm = comm
        self.shard = self.param = shard
        self._grad = torch.empty(shard.shape, pin_memory=shard.is_pinned())
        self.optimizer = make_opt([self.param])

    def refresh(self) -> None:
        """Nothing to do: the shard is the master."""

    def _write_back(self) -> None:
        """Nothing to do: the gathers read the host shard."""


def slot_bytes(optimizer, param) -> float:
    """Bytes of `optimizer`'s per-element state for `param` (Adam's step count aside)."""
    state = optimizer.state.get(param, {}).values()
    return float(sum(v.numel() * v.element_size() for v in state if torch.is_tensor(v) and v.dim()))


def shard_optimizer(offload: str, shard, make_opt, comm=None):
    """The shard's optimizer for `train.offload` (none | optimizer | optimizer+params:
    then `shard` is already in host memory); `comm`: the shard's communicator."""
    if offload == "optimizer":
        return HostShardOptimizer(shard, make_opt, comm)
    if offload == "optimizer+params":
        return HostParamsOptimizer(shard, make_opt, comm)
    return DeviceShardOptimizer(shard, make_opt)
