"""PyTorch backend: zoo models as nn.Modules, gradients averaged by Horovod or MPI.

Horovod wiring follows Horovod's own recipe: `hvd.DistributedOptimizer` with named
parameters (allreduces start during backward, one per gradient, fused by Horovod),
`backward_passes_per_step` for accumulation, broadcast of parameters and optimizer
state from rank 0, and `synchronize()` before clipping so the clip sees the average.
The `mpi` engine (see `gradient_engine`) instead sums one flat gradient buffer with
`MPI_Allreduce` after backward and never starts Horovod.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..exchange import make_reducer
from ..exchange.overlap import OverlapMean
from ..models import zoo
from ..moe.parallel import is_expert_param, local_layers
from ..runtime.memory import peak_rss_bytes
from ..tensor import parallel as tensor_parallel
from . import gradient_engine, torch_moe, torch_tensor
from .base import (
    OPTIMIZER_SLOTS,
    BackendBase,
    EvalStats,
    StepStats,
    build_agreed,
    model_part,
    replicated_memory_plan,
    with_model_prefix,
)
from .torch_zero import TorchZero


def probe() -> dict:
    """Versions and Horovod build facts, for `hpctrain doctor`."""
    import horovod
    import horovod.torch as hvd

    built = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built()}
    missing = [k for k in ("MPI", "Gloo") if not built[k]]
    ops = ", ".join(k for k, v in built.items() if v) or "none"
    return {
        "framework": f"{torch.__version__} (threads {torch.get_num_threads()}, "
        f"CUDA {'yes' if torch.cuda.is_available() else 'no'})",
        "horovod": f"{horovod.__version__}; controllers/ops: {ops}",
        "missing": missing,
    }


# --- the zoo's layer kinds, interpreted with torch ops ---------------------------------
class _Container(nn.Module):
    """An empty module that only groups children, so names come out canonical."""

    def forward(self, *args):  # pragma: no cover - never called
        raise RuntimeError("container")


def _child(root: nn.Module, dotted: str) -> nn.Module:
    node = root
    for part in dotted.split("."):
        if part not in node._modules:
            node.add_module(part, _Container())
        node = node._modules[part]
    return node


def _causal_attention(qkv, heads: int):
    """Masked self-attention of `heads` heads from the packed q, k, v projections
    [n, t, 3 * heads * dh]; returns [n, t, heads * dh]."""
    n, t, width = qkv.shape[0], qkv.shape[1], qkv.shape[-1] // 3
    dh = width // heads
    q, k, v = (z.reshape(n, t, heads, dh).transpose(1, 2) for z in qkv.split(width, -1))
    scores = (q @ k.transpose(-2, -1)) / float(np.sqrt(dh))
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).reshape(n, t, width)


class _Layer(nn.Module):
    def __init__(self, spec: zoo.LayerSpec):
        super().__init__()
        self.spec = spec
        self.p: dict[str, torch.Tensor] = {}
        for name, shape in spec.params.items():
            holder, leaf = self._holder(name)
            param = nn.Parameter(torch.zeros(shape))
            holder.register_parameter(leaf, param)
            self.p[name] = param
        for name, shape in spec.buffers.items():
            holder, leaf = self._holder(name)
            holder.register_buffer(leaf, torch.zeros(shape))
            self.p[name] = getattr(holder, leaf)

    def _holder(self, name: str):
        if "." in name:
            parent, leaf = name.rsplit(".", 1)
            return _child(self, parent), leaf
        return self, name

    def _bn(self, x, prefix):
        return F.batch_norm(
            x,
            self.p[f"{prefix}.running_mean"],
            self.p[f"{prefix}.running_var"],
            self.p[f"{prefix}.weight"],
            self.p[f"{prefix}.bias"],
            training=self.training,
            momentum=zoo.BN_MOMENTUM,
            eps=zoo.BN_EPS,
        )

    def forward(self, x):
        kind, p, a = self.spec.kind, self.p, self.spec.attrs
        if kind == "flatten":
            return x.reshape(x.shape[0], -1)
        if kind == "dense":
            y = F.linear(x, p["weight"], p["bias"])
            return F.relu(y) if a["relu"] else y
        if kind == "conv":
            y = F.conv2d(x, p["weight"], p.get("bias"), stride=a["stride"], padding=a["padding"])
            return F.relu(y) if a["relu"] else y
        if kind == "gap":
            return x.mean(dim=(2, 3))
        if kind == "conv_bn":
            return F.relu(self._bn(F.conv2d(x, p["conv.weight"], None, a["stride"], 1), "bn"))
        if kind == "resblock":
            s = a["stride"]
            out = F.relu(self._bn(F.conv2d(x, p["conv1.weight"], None, s, 1), "bn1"))
            out = self._bn(F.conv2d(out, p["conv2.weight"], None, 1, 1), "bn2")
            if "shortcut.conv.weight" in p:
                x = self._bn(F.conv2d(x, p["shortcut.conv.weight"], None, s, 0), "shortcut.bn")
            return F.relu(out + x)
        if kind == "embed":
            return p["tok.weight"][x] + p["pos.weight"][: x.shape[1]]
        if kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"], zoo.LN_EPS)
        if kind == "block":
            return self._block(x)
        raise ValueError(f"unknown layer kind {kind!r}")

    def _block(self, x):
        if self.spec.attrs.get("tensor", 1) > 1:
            return self._tensor_parallel_block(x)
        p, heads = self.p, self.spec.attrs["n_heads"]
        d = x.shape[-1]
        h = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], zoo.LN_EPS)
        y = _causal_attention(F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"]), heads)
        x = x + F.linear(y, p["attn.proj.weight"], p["attn.proj.bias"])
        h = F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"], zoo.LN_EPS)
        if "moe" in self.spec.attrs:  # mixture-of-experts feed-forward: torch_moe.py
            return x + torch_moe.moe_ffn(self, h)
        h = F.linear(
            F.relu(F.linear(h, p["ffn.fc1.weight"], p["ffn.fc1.bias"])),
            p["ffn.fc2.weight"],
            p["ffn.fc2.bias"],
        )
        return x + h

    def _tensor_parallel_block(self, x):
        """The block with this rank's heads and MLP slice (Megatron): f before the
        column-parallel layers, g after the row-parallel ones, biases after g."""
        p, heads = self.p, self.spec.attrs["n_heads"]  # this rank's heads
        d = x.shape[-1]
        h = torch_tensor.copy_to_tensor_axis(
            F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], zoo.LN_EPS)
        )
        y = _causal_attention(F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"]), heads)
        out = torch_tensor.reduce_from_tensor_axis(F.linear(y, p["attn.proj.weight"]))
        x = x + out + p["attn.proj.bias"]
        h = torch_tensor.copy_to_tensor_axis(
            F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"], zoo.LN_EPS)
        )
        if "moe" in self.spec.attrs:  # this rank's samples through the experts
            lo, hi = tensor_parallel.tensor_group().my_rows(h.shape[0])
            router = torch_tensor.copy_to_tensor_axis(p["moe.router.weight"])
            y = torch_moe.moe_ffn(self, h[lo:hi], router)
            y = F.pad(y, (0, 0, 0, 0, lo, h.shape[0] - hi))  # the other ranks' rows: 0
            return x + torch_tensor.reduce_from_tensor_axis(y)
        h = F.relu(F.linear(h, p["ffn.fc1.weight"], p["ffn.fc1.bias"]))
        out = torch_tensor.reduce_from_tensor_axis(F.linear(h, p["ffn.fc2.weight"]))
        return x + out + p["ffn.fc2.bias"]


class ZooNet(nn.Module):
    """A zoo model: the layers in order, parameters under their canonical names."""

    def __init__(self, layers: list[zoo.LayerSpec]):
        super().__init__()
        self.seq = []
        for spec in layers:
            layer = _Layer(spec)
            if "." in spec.name:
                parent, leaf = spec.name.rsplit(".", 1)
                _child(self, parent).add_module(leaf, layer)
            else:
                self.add_module(spec.name, layer)
            self.seq.append(layer)

    def forward(self, x):
        for layer in self.seq:
            if layer.spec.attrs.get("recompute") and torch.is_grad_enabled():
                # Activation checkpointing: keep the block's input, recompute the rest in
                # backward (non-reentrant: exact gradients, RNG state preserved).
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def build_model(model_cfg: dict, inp: zoo.InputSpec, seed: int) -> nn.Module:
    """A zoo model with the canonical initial weights, or the user's own nn.Module."""
    name = model_cfg["name"]
    if zoo.is_zoo_model(name):
        layers = zoo.build_layers(model_cfg, inp)
        tp = tensor_parallel.tensor_group()  # this rank's shard of each split layer
        model = ZooNet(tensor_parallel.local_layers(local_layers(layers, seed), tp.size))
        # Initial values of all experts (the same at any world size), one tensor at a
        # time; this rank keeps its experts (MoE) and its tensor-parallel pieces.
        mine = model.state_dict(keep_vars=True)
        unset = set(mine)
        with torch.no_grad():
            for key, value in zoo.iter_init_weights(layers, seed):
                if key in mine:
                    part = tensor_parallel.shard(key, value, tp.size, tp.rank)
                    mine[key].copy_(torch.from_numpy(part))
                    unset.discard(key)
                del value
        if unset:  # a zoo layer whose tensors the canonical specs do not name: a bug
            raise RuntimeError(f"no initial value for {sorted(unset)[:3]}")
        return model
    from .torch_user import build_user_model  # import, call, one checked forward pass

    return build_user_model(model_cfg, inp, seed)


def export_optimizer_state(
    optimizer, named_params, kind: str, copy: bool = True
) -> dict[str, np.ndarray]:
    """`optimizer/<slot>/<name>` (+ `optimizer/step` for Adam) in the canonical layout.

    torch creates slots at the first step; before it they are exported as zeros, which is
    what they would start from. copy=False: live slots as views (valid until the next step).
    """
    state, step = {}, 0
    for name, param in named_params:
        st = optimizer.state.get(param, {})
        for slot in OPTIMIZER_SLOTS[kind]:
            value = st.get(slot)
            state[f"optimizer/{slot}/{name}"] = (
                np.zeros(tuple(param.shape), np.float32)
                if value is None
                else (value.detach().numpy().copy() if copy else value.detach().numpy())
            )
        if "step" in st:
            step = int(float(st["step"]))
    if kind == "adam":
        state["optimizer/step"] = np.array(step, dtype=np.int64)
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
            st[slot] = torch.from_numpy(np.array(state[key], dtype=np.float32))
        if kind == "adam":
            st["step"] = torch.tensor(float(step))


def make_optimizer(ocfg: dict, params: list) -> torch.optim.Optimizer:
    """torch's SGD or Adam over `params` as the optimizer section says."""
    if ocfg["name"] == "sgd":
        return torch.optim.SGD(
            params, lr=ocfg["lr"], momentum=ocfg["momentum"], weight_decay=ocfg["weight_decay"]
        )
    return torch.optim.Adam(
        params,
        lr=ocfg["lr"],
        betas=tuple(ocfg["betas"]),
        eps=ocfg["eps"],
        weight_decay=ocfg["weight_decay"],
    )


# --- what the backend, the pipeline stage and the PS worker share ------------------------
def prepare_process(threads: int, deterministic: bool, seed: int) -> None:
    """Threads, deterministic kernels and every random stream of this rank's process."""
    torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def compute_precision(bf16: bool):
    """bf16: torch's CPU autocast (matmuls, convolutions and what follows them in
    bfloat16; parameters, gradients and optimizer state stay float32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray, bf16=False) -> EvalStats:
    """Summed loss, correct predictions and count of one batch in eval mode."""
    model.eval()
    with compute_precision(bf16):
        logits = model(torch.from_numpy(x))
    logits = logits.float()
    yt = torch.from_numpy(y)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yt.reshape(-1), reduction="sum")
    return EvalStats(float(loss), int((logits.argmax(-1) == yt).sum()), int(np.prod(y.shape)))


def rng_state() -> dict[str, np.ndarray]:
    """torch's global generator (dropout and other random layers draw from it)."""
    return {"torch": torch.get_rng_state().numpy().copy()}


def set_rng_state(state: dict[str, np.ndarray]) -> None:
    if "torch" in state:
        torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))


def backward_mean_loss(
    model: nn.Module, micro_batches, aux_loss=None, before_last=None, after_each=None, bf16=False
) -> tuple[float, int, int]:
    """Backward of the mean loss over all the step's samples on this rank (gradients
    accumulate over the micro-batches); returns (loss sum, correct, count).
    `aux_loss(model)`: an extra per-token loss of the last forward (MoE balancing).
    `before_last()`: called before the last micro-batch's backward (the overlapped
    engine starts communication only there, when the gradients become final).
    `after_each()`: called after each micro-batch's backward (ZeRO-2 reduces there)."""
    total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
    loss_sum, correct = 0.0, 0
    for i, (x, y) in enumerate(micro_batches):
        if before_last is not None and i == len(micro_batches) - 1:
            before_last()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        with compute_precision(bf16):
            logits = model(xt)
        logits = logits.float()  # the loss in float32 (as autocast does)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), yt.reshape(-1), reduction="sum"
        )
        aux = aux_loss(model) if aux_loss is not None else None
        term = loss if aux is None else loss + aux * yt.numel()
        (term / total).backward()
        if after_each is not None:
            after_each()
        loss_sum += float(loss.detach())
        correct += int((logits.detach().argmax(-1) == yt).sum())
    return loss_sum, correct, total


# --- the backend ------------------------------------------------------------------------
class TorchBackend(BackendBase):
    name = "torch"

    def __init__(self, cfg, world, inp: zoo.InputSpec, threads: int, hvd_comm=None):
        self.cfg = cfg
        self.world = world
        local = getattr(world, "local_size", 1)  # a grid axis has no node layout
        self.engine, self.engine_reason = gradient_engine.choose(cfg, local, threads, world=world)
        self.inp = inp
        self.bf16 = cfg.train["precision"] == "bf16"
        seed = cfg.train["seed"]
        rank = world.rank if world is not None else 0
        prepare_process(threads, cfg.train["deterministic"], seed + rank)
        self.model = build_agreed(world, lambda: build_model(cfg.model, inp, seed))
        self._names = OrderedDict((p, n) for n, p in self.model.named_parameters())
        ocfg = cfg.optimizer
        dense = torch_moe.dense_named_parameters(self.model)  # all but MoE experts
        params = [p for _, p in dense]
        self.zero = None  # ZeRO-1/2: the optimizer holds this rank's shard only
        if cfg.train["zero"]:
            self.zero = TorchZero(
                world,
                params,
                cfg.train["zero"],
                int(cfg.train["bucket_mb"] * 2**20),
                partial(make_optimizer, ocfg),
            )
            opt = self.zero.optimizer
        else:
            opt = make_optimizer(ocfg, params)
        self.accum = cfg.train["grad_accum"]
        self.hvd = None
        if self.engine == "horovod":
            import horovod.torch as hvd

            if not hvd.is_initialized():
                hvd.init(comm=hvd_comm if hvd_comm is not None else world.comm)
            self.hvd = hvd
            compression = (
                hvd.Compression.fp16 if cfg.train["compression"] == "fp16" else hvd.Compression.none
            )
            opt = hvd.DistributedOptimizer(
                opt,
                named_parameters=dense,
                compression=compression,
                backward_passes_per_step=self.accum,
                op=hvd.Average,
            )
        self._dense = params
        self._fence = None  # an async save still copying export_state's views (save())
        # modules with buffers (BatchNorm statistics) may change them in a forward
        self._forward_writes = any(True for _ in self.model.buffers())
        self._flat = (
            self.zero.part
            if self.zero is not None
            else make_reducer(cfg, world, [tuple(p.shape) for p in params], engine=self.engine)
        )
        self._overlap = None  # the overlapped engine: buckets started from backward hooks
        if self.engine == "overlap":
            self._overlap = self._flat = OverlapMean(
                world, [p.numel() for p in params], int(cfg.train["bucket_mb"] * 2**20)
            )
            self._arrived = [False] * len(params)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, i))
        self._hooks_live = False
        self.optimizer = opt
        torch_moe.add_expert_params(self.optimizer, self.model)  # local, never allreduced
        self.broadcast_from_root()
        self.clip = cfg.train["clip_norm"]
        self.tokens = inp.tokens
        self.exchange_step = 0  # optimizer steps taken (reducers' warm-up, local SGD)

    def broadcast_from_root(self) -> None:
        """Make every replica start from rank 0's parameters and optimizer state.

        Horovod's broadcast_optimizer_state initialises an empty optimizer by taking a
        zero-gradient step; for Adam that advances the step count to 1 and changes the bias
        correction of every later step. A fresh optimizer has nothing to broadcast, so the
        state is only broadcast once it exists (after a resume).
        """
        state = {k: v for k, v in self.model.state_dict().items() if not is_expert_param(k)}
        if self.hvd is None:
            self._broadcast_with_mpi(state)
            return
        self.hvd.broadcast_parameters(state, root_rank=0)
        # Rank 0 decides for everyone: the branch must be the same on every rank.
        if self.hvd.broadcast_object(bool(self.optimizer.state), root_rank=0, name="has_state"):
            self.hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    def _broadcast_with_mpi(self, state) -> None:
        w = self.world
        if w is None or w.size == 1:
            return
        for name, tensor in state.items():
            w.bcast_inplace(tensor.numpy(), what=f"broadcast {name}")
        if self.zero is not None:  # each rank's optimizer state is its own shard
            self.zero.sync_shard()
            return
        if w.bcast_object(bool(self.optimizer.state), what="agree on optimizer state"):
            named = [(n, p) for p, n in self._names.items() if not is_expert_param(n)]
            kind = self.cfg.optimizer["name"]
            slots = export_optimizer_state(self.optimizer, named, kind) if w.is_root else None
            slots = w.bcast_object(slots, what="broadcast optimizer state")
            import_optimizer_state(self.optimizer, named, kind, slots)

    # --- training ---------------------------------------------------------------

    def hold_exported_state(self, fence) -> bool:
        """An async checkpoint copies export_state's views while the next step runs:
        `fence()` (the copy's end) is awaited before anything here changes them, i.e.
        the next optimizer update, a forward that updates buffers, set_weights,
        import_state and average_buffers."""
        self._fence = fence
        return True

    def _release_exported(self) -> None:
        fence, self._fence = self._fence, None
        if fence is not None:
            fence()

    def train_step(self, micro_batches, lr: float) -> StepStats:
        if self._forward_writes:
            self._release_exported()
        if self.zero is not None:
            return self._zero_step(micro_batches, lr)
        self.model.train()
        t_step = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        before_last = self._open_buckets if self._overlap is not None else None
        loss_sum, correct, total = backward_mean_loss(
            self.model, micro_batches, torch_moe.aux_loss, before_last, bf16=self.bf16
        )
        t0 = time.perf_counter()
        if self._overlap is not None:
            self._finish_buckets()
        elif self.hvd is None:
            self._average_with_mpi()
        else:
            self.optimizer.synchronize()
        torch_moe.average_expert_grads(self.model)
        comm = time.perf_counter() - t0
        if self.clip is not None and tensor_parallel.tensor_group().size > 1:
            torch_tensor.clip_grad_norm_(list(self.model.named_parameters()), self.clip)
        elif self.clip is not None:
            torch_moe.clip_grad_norm_(self.model, self.clip)
        self._release_exported()  # the copy overlapped forward and backward; now update
        if self.hvd is None:
            self.optimizer.step()
        else:
            with self.optimizer.skip_synchronize():
                self.optimizer.step()
        extra = torch_moe.step_extra(self.model, time.perf_counter() - t_step)
        if self.hvd is None:
            extra.update(self._flat.stats())
        extra.update(self.memory())
        return StepStats(loss_sum, correct, total, comm, extra)

    def _zero_step(self, micro_batches, lr: float) -> StepStats:
        """ZeRO-1/2: reduce-scatter, clip by the global norm, update the shard, allgather."""
        self.model.train()
        z = self.zero
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        z.begin_step()
        experts = self._expert_params()
        for p in experts:  # local experts: plain gradients, stepped with the shard
            p.grad = None
        t_comm = [0.0]

        def after_backward():  # stage 2 reduces during backward: count it as comm
            t0 = time.perf_counter()
            z.end_backward()
            t_comm[0] += time.perf_counter() - t0

        loss_sum, correct, total = backward_mean_loss(
            self.model,
            micro_batches,
            torch_moe.aux_loss,
            after_each=after_backward,
            bf16=self.bf16,
        )
        t0 = time.perf_counter()
        z.reduce()
        torch_moe.average_expert_grads(self.model)
        if self.clip is not None:
            extra_sq = 0.0
            if experts:  # each expert lives on one rank of its group
                local = sum(
                    float(p.grad.double().pow(2).sum()) for p in experts if p.grad is not None
                )
                extra_sq = torch_moe.expert_group().allreduce_sum(local)
            coef = z.clip(float(self.clip), self._tensor_split_mask(), extra_sq)
            for p in experts:
                if p.grad is not None and coef < 1.0:
                    p.grad.mul_(coef)
        self._release_exported()
        z.step()  # the shard's update (and the local experts', same optimizer)
        comm = t_comm[0] + time.perf_counter() - t0  # includes the shard's update
        self.exchange_step += 1
        extra = {"comm_bytes": float(z.part.take_sent()), "compression_ratio": 1.0}
        extra.update(self.memory())
        return StepStats(loss_sum, correct, total, comm, extra)

    def _expert_params(self) -> list:
        return [p for p, n in self._names.items() if is_expert_param(n)]

    def _expert_named(self) -> list:
        return [(n, p) for p, n in self._names.items() if is_expert_param(n)]

    def _tensor_split_mask(self):
        """(shard mask of tensor-split parameters, tensor group), or None without TP."""
        group = tensor_parallel.tensor_group()
        if group.size == 1:
            return None
        if not hasattr(self, "_split_mask"):
            split = {
                i
                for i, p in enumerate(self._dense)
                if tensor_parallel.split_kind(self._names[p]) is not None
            }
            self._split_mask = self.zero.part.shard_mask(split)
        return self._split_mask, group

    def memory_plan(self) -> dict[str, float]:
        """Bytes of gradients and optimizer state this rank will hold once training runs
        (`grad`, `optimizer`) and how much of them is resident now (`*_now`: torch
        allocates optimizer state at the first step; numpy buffers fill at first use)."""
        slots = len(OPTIMIZER_SLOTS[self.cfg.optimizer["name"]])
        opt_now = self.memory()["mem_optimizer_bytes"]
        if self.zero is not None:
            e, z = self.zero.part.expected_bytes(slots), self.zero
            return {
                "grad": e["zero_model_grad_bytes"] + z.part.largest_segment_bytes(),
                "grad_now": float(z.part.flat_len * 4 if z.part.stage == 1 else 0),
                "optimizer": e["zero_model_optimizer_bytes"],
                "optimizer_now": opt_now,
            }
        trainable = sum(p.numel() * 4 for p in self.model.parameters() if p.requires_grad)
        return replicated_memory_plan(trainable, self._flat, slots, opt_now)

    def memory(self) -> dict[str, float]:
        """Per-rank bytes of parameters, gradients and optimizer state, and peak RSS."""
        slots = len(OPTIMIZER_SLOTS[self.cfg.optimizer["name"]])
        if self.zero is not None:
            out = self.zero.memory(slots)
        else:
            grads = sum(p.grad.numel() * 4 for p in self.model.parameters() if p.grad is not None)
            buffer = getattr(self._flat, "buffer", None)
            opt = sum(
                v.numel() * v.element_size()
                for st in self.optimizer.state.values()
                for v in st.values()
                if torch.is_tensor(v) and v.dim() > 0
            )
            out = {
                "mem_param_bytes": float(sum(p.numel() * 4 for p in self.model.parameters())),
                "mem_grad_bytes": float(grads + (buffer.nbytes if buffer is not None else 0)),
                "mem_optimizer_bytes": float(opt),
            }
        out["mem_peak_rss_bytes"] = float(peak_rss_bytes())
        return out

    @torch.no_grad()
    def _average_with_mpi(self) -> None:
        """One MPI_Allreduce of every dense gradient (the `mpi` engine)."""
        if self.world is None or self.world.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._dense]
        flat = torch.from_numpy(self._flat.buffer)
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        self._flat.reduce(self.exchange_step)
        self.exchange_step += 1
        for p, view in zip(self._dense, flat.split(self._flat.sizes)):
            if p.grad is not None:  # a parameter without gradient stays without
                p.grad.copy_(view.view_as(p))

    # --- the overlapped engine (exchange/overlap.py does the MPI side) -------------
    def _open_buckets(self) -> None:
        """The next backward makes the gradients final: let the hooks send them."""
        self._overlap.begin()
        self._arrived = [False] * len(self._dense)
        self._hooks_live = self.world is not None and self.world.size > 1

    @torch.no_grad()
    def _grad_ready(self, index: int, param) -> None:
        if not self._hooks_live:
            return
        self._overlap.views[index][:] = param.grad.reshape(-1).numpy()
        self._arrived[index] = True
        self._overlap.ready(index)

    @torch.no_grad()
    def _finish_buckets(self) -> None:
        """Zeros for parameters without gradient (as the sync engine), wait, copy back."""
        if not self._hooks_live:
            return
        self._hooks_live = False
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                self._overlap.views[i][:] = 0.0
                self._overlap.ready(i)
        self._overlap.finish()
        for p, view in zip(self._dense, self._overlap.views, strict=True):
            if p.grad is not None:
                p.grad.copy_(torch.from_numpy(view).view_as(p))
        self.exchange_step += 1

    def evaluate(self, x, y) -> EvalStats:
        return evaluate_model(self.model, x, y, self.bf16)

    @torch.no_grad()
    def predict(self, x) -> np.ndarray:
        self.model.eval()
        with compute_precision(self.bf16):
            return self.model(torch.from_numpy(x)).float().numpy()

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics, which Horovod leaves per replica."""
        self._release_exported()
        for name, buf in self.model.named_buffers():
            if self.hvd is not None:
                buf.copy_(self.hvd.allreduce(buf, name=f"buffer.{name}", op=self.hvd.Average))
            else:  # the numpy view shares the buffer's memory
                gradient_engine.average_array(self.world, buf.numpy(), f"average buffer {name}")

    # --- state ------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self._names.values())

    def get_weights(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v.copy()) for k, v in self._live_weights().items())

    def _live_weights(self) -> OrderedDict[str, np.ndarray]:
        """Views of the model's parameters and buffers (valid until the next step)."""
        return OrderedDict((k, v.detach().numpy()) for k, v in self.model.state_dict().items())

    def weight_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.check_weights(weights, self.weight_shapes())
        self._release_exported()
        with torch.no_grad():
            for key, tensor in self.model.state_dict(keep_vars=True).items():
                tensor.copy_(torch.from_numpy(np.asarray(weights[key], dtype=np.float32)))
        if self.zero is not None:
            self.zero.sync_shard()

    def export_state(self) -> dict[str, np.ndarray]:
        """The canonical state; under ZeRO a collective whose result is whole on rank 0.
        Valid until the next step (without ZeRO, views of the live tensors)."""
        if self.zero is not None:
            names = [self._names[p] for p in self._dense]
            kind = self.cfg.optimizer["name"]
            return {
                **with_model_prefix(self.get_weights()),
                **export_optimizer_state(self.optimizer, self._expert_named(), kind),
                **self.zero.export_optimizer(names, kind),
            }
        # Views of the live tensors, no copy: a checkpoint writes them before the next
        # step, or an async save copies them into its reused buffers (staging.py).
        names = ((n, p) for p, n in self._names.items())
        return {
            **with_model_prefix(self._live_weights()),
            **export_optimizer_state(self.optimizer, names, self.cfg.optimizer["name"], False),
        }

    def export_owned_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Under ZeRO: (the replicated canonical state, {name: (shape, start, elements)}
        this rank alone holds, its optimizer shard), so a sharded checkpoint needs no
        communication."""
        names = [self._names[p] for p in self._dense]
        kind = self.cfg.optimizer["name"]
        replicated = {
            **with_model_prefix(self.get_weights()),  # with experts: each rank its own
            **export_optimizer_state(self.optimizer, self._expert_named(), kind),
            **self.zero.step_state(kind),
        }
        return replicated, self.zero.optimizer_pieces(names, kind)

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

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)

    def versions(self) -> dict[str, str]:
        import horovod

        return {"framework": "torch " + torch.__version__, "horovod": horovod.__version__}
