"""One pipeline stage in torch: a contiguous slice of a zoo model and its optimizer.

The slice is built from the backend's own `ZooNet`/`_Layer`, so its parameters carry
the canonical names of a full model (`fc2.weight`, `layer2.0.conv1.weight`) and a
pipeline checkpoint is a data-parallel checkpoint cut into pieces. A forward keeps the
micro-batch's stage input (a leaf that requires grad) and output until its backward,
which is `torch.autograd.backward(output, gradient_from_next_stage)`; the input's
`.grad` is what goes to the previous stage. Gradients accumulate over the step's
micro-batches and the optimizer steps once, with torch's own SGD/Adam.

ZeRO-1 (`train.zero: 1`, `attach_zero`): the stage's parameters become views of one
flat tensor sharded over the stage's replicas (torch_zero.py); gradients accumulate
into the flat gradient over the micro-batches and are reduce-scattered once per step,
each replica updates its shard with its own optimizer state, and the updated shards
are all-gathered. (ZeRO-2 would reduce-scatter after every micro-batch: refused.)

On a process group's links (`gloo` on CPU or GPU ranks, `nccl` on GPU ranks: `device`
given) the stage computes on its device and its messages stay tensors there: batches
arrive through a DeviceFeeder (pinned slots and a copy stream on a GPU), the step's loss
and correct counts stay 0-d tensors until the loop reads them (read_later), and the
clip's sums of squares are tensors too, so a GPU stage's step reads nothing back to the
host (over Gloo its messages do cross the host: Gloo's point-to-point calls take host
memory). On the MPI and Horovod engines (CPU ranks) messages are numpy arrays.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from ..moe.parallel import is_expert_param
from . import gradient_engine, torch_moe
from .base import model_part, split_square_sums, with_model_prefix
from .gradient_engine import average_array
from .horovod_env import init_process_sets
from .stage_base import StageBase
from .torch_arrays import scale_grads_
from .torch_device import DeviceFeeder, read_later, to_host
from .torch_model import ZooNet
from .torch_state import optimizer_state_bytes, state_memory_plan
from .torch_steps import (
    compute_precision,
    export_optimizer_state,
    import_optimizer_state,
    make_optimizer,
    prepare_process,
    rng_state,
    set_rng_state,
)
from .torch_zero import TorchZero


def init_replicas(comm, groups: list[list[int]], mine: int):
    """Horovod with one process set per stage (horovod_env.init_process_sets)."""
    import horovod.torch as hvd

    return init_process_sets(hvd, comm, groups, mine)


class TorchStage(StageBase):
    """Layers [start, stop) of the model as nn.Modules; see the module docstring."""

    prepare_process = staticmethod(prepare_process)

    def build(self, layers, weights) -> None:
        self.tensors = self.device is not None  # messages stay tensors on the device
        self.on = self.device if self.tensors else torch.device("cpu")
        # x and y of every micro-batch of a step may share one ring of pinned slots
        self._feed = DeviceFeeder(self.on, depth=2 * self.microbatches + 2).put
        self.net = ZooNet(layers, self.groups).to(self.on)
        self.set_weights(weights)
        # MoE experts in this stage: local to a rank of the stage's expert group; their
        # gradients are scaled (hooks) and averaged over their copies, not the replicas
        self._experts = torch_moe.scale_expert_grads(self.net, self.groups.experts)
        self.opt = make_optimizer(self._ocfg, list(self.net.parameters()))

    def attach_mpi(self, replicas, transport=None) -> None:
        """The `mpi` engine: average over `replicas` (a guarded communicator) with one
        flat MPI_Allreduce per step instead of Horovod; or, given the replicas'
        process-group `transport` (`gloo`, `nccl`), one allreduce of a flat tensor over it
        (buffers such as BatchNorm's still average over MPI, once per evaluation)."""
        self.mpi = replicas
        on = transport if transport is not None else replicas
        self._flat = gradient_engine.FlatMean(on, [p.numel() for p in self._dense()], arrays=on)

    def attach_zero(self, replicas, bucket_bytes: int, transport=None) -> None:
        """ZeRO-1 over the stage's replicas (a guarded communicator; or, given their
        process group's `transport`, `gloo`, the flat gradient and the shard tensors on
        the stage's device): the optimizer holds this replica's shard of the stage's
        state only."""
        self.mpi = replicas
        params = list(self.net.parameters())
        self.zero = TorchZero(
            replicas, params, 1, bucket_bytes, partial(make_optimizer, self._ocfg), transport
        )
        self.opt = self.zero.optimizer
        self._names = [n for n, _ in self.net.named_parameters()]
        self.zero.begin_step()

    # --- the schedule's two actions --------------------------------------------
    def forward(self, micro: int, x, y: np.ndarray | None, scale: float):
        """Run micro-batch `micro`; returns the activation to send (None on the last stage)."""
        self.net.train()
        # numpy from MPI or the data (fed to the device), a tensor from a process group
        xt = x if torch.is_tensor(x) else self._feed(x)
        if not self.first:
            xt.requires_grad_(True)
        with compute_precision(self.precision, self.on.type):  # bf16: autocast
            out = self.net(xt)
        aux = torch_moe.aux_loss(self.net)  # MoE balancing, weighted per token like the loss
        aux = None if aux is None else aux * (int(np.prod(x.shape[:2])) * scale)
        if self.last:
            yt = self._feed(y)
            loss = _loss(out.float(), yt)  # the loss in float32, as autocast does
            # float64 0-d tensors, read after the step (read_later): no host wait here
            self.loss_sum = self.loss_sum + loss.detach().double()
            if self.tally:
                self.correct = self.correct + (out.detach().argmax(-1) == yt).sum()
            out = loss * scale  # this rank's share of the step's mean loss
            out, aux = (out if aux is None else out + aux), None
        else:  # messages are float32 (exact from bf16; its backward casts the gradient)
            out = out.float()
        self.stash[micro] = (xt, out, aux)
        self.peak_stash = max(self.peak_stash, len(self.stash))
        if self.last:
            return None
        return out.detach() if self.tensors else out.detach().numpy()

    def backward(self, micro: int, grad):
        """Backward of `micro`; returns the gradient for the previous stage (None on the first)."""
        xt, out, aux = self.stash.pop(micro)
        upstream = None if grad is None else torch.as_tensor(grad)
        if self.last:
            torch.autograd.backward(out)
        elif aux is None:
            torch.autograd.backward(out, upstream)
        else:  # the stage's balancing loss joins the gradient from the next stage
            torch.autograd.backward([out, aux], [upstream, None])
        if self.first:
            return None
        if not self.tensors:
            return xt.grad.numpy()  # the engine copies it if it is the upstream buffer
        back = xt.grad
        if upstream is not None and _same_storage(back, upstream):
            back = back.clone()  # a reshape-only stage passes the received buffer through
        return back

    # --- the step ----------------------------------------------------------------
    def grad_square_sum(self) -> float:
        return sum(self.grad_square_sums(lambda name: False))

    def grad_square_sum_tensors(self, is_split):
        """(split, replicated) float64 0-d tensors of the squared gradient norm where the
        gradients are (the process-group links' clip: no host read), summed in the order
        of grad_square_sums, so both give the same float64 values: MoE experts, each on
        one rank of its group, summed over the group's transport and counted with the
        replicated ones. Under ZeRO-1 (dense stages) from the replicas' shards of the
        averaged gradient."""
        if self.zero is not None:
            sums = self.zero.part.square_sum_array(self.zero.shard_grad, self._split_mask(is_split))
            return sums[0], sums[1]
        zero = torch.zeros((), dtype=torch.float64, device=self.on)
        split = whole = experts = zero
        for name, p in self.net.named_parameters():
            if p.grad is None:
                continue
            sq = (p.grad.double() ** 2).sum()
            if is_expert_param(name):
                experts = experts + sq
            elif is_split(name):
                split = split + sq
            else:
                whole = whole + sq
        if self._experts:
            whole = whole + self.groups.experts.allreduce_sum(experts)
        return split, whole

    def _split_mask(self, is_split):
        """ZeRO-1: where this replica's shard holds split parameters (an array on the
        stage's device, made once per rule), or None where none is split."""
        cached = getattr(self, "_mask_of", None)
        if cached is not None and cached[0] is is_split:
            return cached[1]
        part, names = self.zero.part, [n for n, _ in self.net.named_parameters()]
        ids = {i for i, n in enumerate(names) if is_split(n)}
        mask = part.arrays.from_host(part.shard_mask(ids)) if ids else None
        self._mask_of = (is_split, mask)
        return mask

    def grad_square_sums(self, is_split) -> tuple[float, float]:
        """(split, replicated) squared gradient norms (base.split_square_sums)."""
        named = list(self.net.named_parameters())

        def squares():
            return [
                0.0 if p.grad is None else float((p.grad.double() ** 2).sum()) for _, p in named
            ]

        names = [n for n, _ in named]
        return split_square_sums(names, squares, is_split, self.zero, self.groups.experts)

    def average_grads(self) -> float:
        """Average gradients over this stage's replicas; returns seconds spent."""
        if self.zero is not None:  # reduce-scatter: this replica's shard of the mean
            t0 = time.perf_counter()
            self.zero.reduce()
            return time.perf_counter() - t0
        if self.mpi is not None:
            seconds = self._average_with_mpi()
            t0 = time.perf_counter()
            torch_moe.average_expert_grads(
                self.net, self.groups.experts
            )  # over each expert's copies
            return seconds + time.perf_counter() - t0
        if self.hvd is None or self.process_set.size() == 1:
            return 0.0
        t0 = time.perf_counter()
        params = self._grads()
        with self.horovod_wait("Horovod stage gradient allreduce"):
            avg = self.hvd.grouped_allreduce(
                [p.grad for p in params], op=self.hvd.Average, process_set=self.process_set
            )
        for p, g in zip(params, avg, strict=True):
            p.grad.copy_(g)
        return time.perf_counter() - t0

    @torch.no_grad()
    def _average_with_mpi(self) -> float:
        if self.mpi.size == 1:
            return 0.0
        t0 = time.perf_counter()
        params = self._dense()
        flat = torch.as_tensor(self._flat.buffer)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        self._flat.reduce()
        for p, view in zip(params, flat.split(self._flat.sizes), strict=True):
            if p.grad is not None:
                p.grad.copy_(view.view_as(p))
        return time.perf_counter() - t0

    def apply(self, lr: float, clip_coef=1.0) -> None:
        """One optimizer step with the accumulated (averaged, clipped) gradients.
        clip_coef: a float, or a 0-d tensor on the device (every gradient scaled by it:
        1 under the limit is exact, and no host `if` waits for the device)."""
        if self.zero is not None:
            if torch.is_tensor(clip_coef):  # the device's coefficient: 1 is exact
                self.zero.shard_grad.mul_(clip_coef)
            elif clip_coef < 1.0:
                self.zero.shard_grad *= np.float32(clip_coef)
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.zero.step()  # the shard's update, then every replica's shard gathered
            self.zero.begin_step()  # the next step's gradients accumulate from zero
            return
        if torch.is_tensor(clip_coef):
            scale_grads_([p.grad for p in self._grads()], clip_coef)
        elif clip_coef < 1.0:
            for p in self._grads():
                p.grad.mul_(clip_coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _grads(self):
        return [p for p in self.net.parameters() if p.grad is not None]

    def _dense(self) -> list:
        """The parameters every replica of the stage holds (all but MoE experts)."""
        return [p for n, p in self.net.named_parameters() if not is_expert_param(n)]

    def take_stats(self):
        """(loss sum, correct) of the step: 0-d tensors on the last stage (NaN correct
        on a step that did not count them), read by read_later."""
        out = (self.loss_sum, self.correct if self.tally else float("nan"))
        self.loss_sum, self.correct = 0.0, 0
        return out

    def read_later(self, stats):
        return read_later(stats)

    def moe_metrics(self, step_seconds: float) -> dict:
        """This step's MoE metrics of the stage's layers ({} without them); resets."""
        return torch_moe.step_extra(self.net, step_seconds)

    def memory_plan(self) -> dict[str, float]:
        """The gradients and optimizer state this stage's rank will hold, and what of them
        it holds now (the limit check after the build: torch_state.state_memory_plan)."""
        opt_now = optimizer_state_bytes(self.opt)  # none before the first step
        name = self._ocfg["name"]
        return state_memory_plan(self.net.parameters(), self.zero, self._flat, name, opt_now)

    def peak_memory(self) -> tuple[float, str]:
        """The CUDA allocator's peak of a GPU stage (allocated: what its tensors held),
        else the peak RSS."""
        if self.on.type != "cuda":
            return super().peak_memory()
        return float(torch.cuda.max_memory_allocated(self.on)), "CUDA peak allocated"

    # --- forward only ------------------------------------------------------------
    @torch.no_grad()
    def infer(self, x) -> np.ndarray:
        """Eval-mode forward (shape probing, validation); last stage returns logits."""
        self.net.eval()
        xt = torch.as_tensor(x).to(self.on)
        with compute_precision(self.precision, self.on.type):
            out = self.net(xt)
        return to_host(out.float(), copy=False)

    def average_buffers(self) -> None:
        if self.mpi is not None:
            for name, buf in self.net.named_buffers():
                host = to_host(buf, copy=False)  # a view on CPU, a copy from a GPU
                average_array(self.mpi, host, f"average buffer {name}")
                if buf.device.type != "cpu":
                    buf.copy_(torch.from_numpy(host))
            return
        if self.hvd is None or self.process_set.size() == 1:
            return
        for name, buf in self.net.named_buffers():
            with self.horovod_wait(f"Horovod stage buffer average {name}"):
                buf.copy_(
                    self.hvd.allreduce(
                        buf,
                        name=f"buffer.{name}",
                        op=self.hvd.Average,
                        process_set=self.process_set,
                    )
                )

    # --- canonical state ------------------------------------------------------------
    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, to_host(v)) for k, v in self.net.state_dict().items())

    def set_weights(self, weights) -> None:
        """Every tensor of the stage from `weights`: a dict, or (name, value) pairs, taken
        one at a time (the initial values, never all held at once)."""
        pairs = weights.items() if isinstance(weights, dict) else weights
        tensors = self.net.state_dict(keep_vars=True)
        missing = set(tensors)
        with torch.no_grad():
            for key, value in pairs:
                if key in tensors:
                    tensors[key].copy_(torch.from_numpy(np.asarray(value, dtype=np.float32)))
                    missing.discard(key)
        if missing:
            raise KeyError(f"no value for {sorted(missing)[:3]} of the stage's tensors")
        if self.zero is not None:
            self.zero.sync_shard()

    def export_state(self) -> dict[str, np.ndarray]:
        """This stage's part of a checkpoint, in the data-parallel backend's layout
        (ZeRO: collective over the replicas, the optimizer state on replica 0)."""
        kind = self._ocfg["name"]
        if self.zero is not None:
            return {
                **with_model_prefix(self.get_weights()),
                **self.zero.export_optimizer(self._names, kind),
            }
        return {
            **with_model_prefix(self.get_weights()),
            **export_optimizer_state(self.opt, self.net.named_parameters(), kind),
        }

    def export_owned(self) -> tuple[dict, dict]:
        """ZeRO: (the weights, this replica's own ranges of the optimizer state as
        {name: (shape, first, elements)}), without communication."""
        kind = self._ocfg["name"]
        step = self.zero.step_state(kind)
        return (
            {**with_model_prefix(self.get_weights()), **step},
            self.zero.optimizer_pieces(self._names, kind),
        )

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        """Take this stage's tensors (and their optimizer slots) from a full checkpoint."""
        self.set_weights(model_part(state))
        kind = self._ocfg["name"]
        if self.zero is not None:
            self.zero.import_optimizer(self._names, kind, state)
            return
        import_optimizer_state(self.opt, self.net.named_parameters(), kind, state)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)


def _same_storage(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


def layer_forward_seconds(layers, layer_weights, x: np.ndarray, repeats: int = 3) -> list[float]:
    """Median forward time of each layer on input `x` (for `partition: time`), one
    layer built at a time: `layer_weights` gives each layer's {name: value} in order,
    so the model is never held whole."""
    out, xt = [], torch.from_numpy(x)
    for spec, weights in zip(layers, layer_weights, strict=True):
        net = ZooNet([spec])
        with torch.no_grad():
            for key, tensor in net.state_dict(keep_vars=True).items():
                tensor.copy_(torch.from_numpy(weights[key]))
        net.train()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = net(xt)
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
        xt = y.detach()
        del net, weights
    return out
