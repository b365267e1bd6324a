"""Megatron-style tensor parallelism for the zoo transformer, framework-free.

The grid's `tensor` axis (T ranks, `parallel.tensor`) splits every block: the QKV
projection and the first MLP layer by output rows (column-parallel: each rank computes
its heads and its slice of the hidden layer), the attention output projection and the
second MLP layer by input columns (row-parallel: each rank's partial product is summed
over the axis). Per block and pass that is one allreduce after attention and one after
the MLP in forward (`g`), and one before each in backward (`f`), of the activations
[batch, seq, d_model]: cost per rank 2 x 2 (T-1)/T x the activations, independent of
the number of data replicas (1,024 or 4,096 ranks change nothing inside a tensor group).

Embeddings, layer norms, the head and the biases added after `g` are replicated; their
gradients are the same on every rank of the axis (the `f` allreduce makes the inputs'
gradients whole), so they need no tensor-axis reduction.

Mixture-of-experts blocks (DeepSpeed's "drop duplicate tokens"): attention is split
as above; the MoE feed-forward is not split but its tokens are. Every rank of a tensor
group holds the same [batch, seq, d_model] input, so rank t routes only samples
`my_rows` (1/T of them) to the experts, which live on the expert x tensor ranks of the
replica (moe/parallel.py), and the outputs are joined with one allreduce of the
zero-padded rows (`g`; twice an allgather's bytes, for one collective fewer to write);
backward, `f` before the row split makes the input's gradient whole again. The router
weight goes through `f` too: each rank's copy saw 1/T of the tokens, so its gradient is
summed over the axis.

Canonical names and shapes never change: `shard` cuts a full array into this rank's
piece, `unshard` joins the pieces, so checkpoints are world- and T-independent.
"""

from __future__ import annotations

import copy

import numpy as np

ROW_COLUMNS = ("attn.proj.weight", "ffn.fc2.weight")


class TensorGroup:
    """The tensor axis of this rank (a guarded communicator) and the activation sums.
    Made from the process grid (backends/groups.py), passed to the model that uses it;
    `TensorGroup(None)`: no tensor parallelism (one rank, nothing to sum).

    `transport`: where a backend sums activations on its own arrays (exchange/
    transport.py; the torch backend's process group on the process-group engines), or
    None (host numpy over `axis`). The gradient norm's squares follow their array: the
    transport's arrays over it, numpy over `axis` (`sum_squares`)."""

    def __init__(self, axis=None, transport=None):
        self.axis, self.transport = axis, transport
        self.size = axis.size if axis is not None else 1
        self.rank = axis.rank if axis is not None else 0

    def with_transport(self, transport) -> TensorGroup:
        """This axis with activations summed over `transport` (the same ranks, in the
        same order: checked)."""
        if transport is None or self.size == 1:
            return self
        if (transport.rank, transport.size) != (self.rank, self.size):
            raise ValueError(
                f"tensor axis transport is rank {transport.rank} of {transport.size}, the "
                f"axis rank {self.rank} of {self.size}"
            )
        return TensorGroup(self.axis, transport)

    @classmethod
    def planned(cls, size: int) -> TensorGroup:
        """Tensor rank 0 of `size` ranks, without a communicator: the shapes the memory
        plan needs (its forward runs on torch's fake tensors and never sums)."""
        group = cls(None)
        group.size = size
        return group

    def my_rows(self, n: int) -> tuple[int, int]:
        """[lo, hi) of the n samples of the group's batch that this rank routes through
        a mixture-of-experts layer (each rank 1/T of them: no token goes twice)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def allreduce_sum(self, x: np.ndarray, what: str) -> np.ndarray:
        buf = np.ascontiguousarray(x, dtype=np.float32).copy()
        if self.size > 1:
            self.axis.allreduce_inplace(buf, "sum", f"tensor-parallel {what}")
        return buf

    def sum_squares(self, buf, what: str):
        """A 1-D float64 buffer of squared norms summed over the axis, in place: a
        transport's array over the transport (no host wait on a device), numpy over
        `axis`. Float64 on both, so the two paths round alike."""
        if self.size == 1:
            return buf
        on = self.axis if isinstance(buf, np.ndarray) or self.transport is None else self.transport
        return on.allreduce_inplace(buf, "sum", f"tensor-parallel {what}")


def split_kind(name: str) -> str | None:
    """'qkv' (rows per head of q, k, v), 'rows', 'cols' or None (replicated)."""
    for leaf in ("attn.qkv.weight", "attn.qkv.bias"):
        if name.endswith(leaf):
            return "qkv"
    if name.endswith(("ffn.fc1.weight", "ffn.fc1.bias")):
        return "rows"
    if name.endswith(ROW_COLUMNS):
        return "cols"
    return None


def shard(name: str, full: np.ndarray, size: int, rank: int) -> np.ndarray:
    """This rank's piece of a canonical array (a copy); replicated arrays whole."""
    kind = split_kind(name)
    if kind is None or size == 1:
        return np.array(full, copy=True)
    if kind == "qkv":  # q, k and v rows each split by heads
        parts = np.split(full, 3, axis=0)
        return np.concatenate([np.split(p, size, axis=0)[rank] for p in parts], axis=0)
    axis = 0 if kind == "rows" else 1
    return np.array(np.split(full, size, axis=axis)[rank], copy=True)


def shard_state(state: dict, size: int, rank: int) -> dict:
    """This rank's piece of every split array of a canonical dict (`model/<name>`,
    `optimizer/<slot>/<name>` or bare names, split by the leaf name); the rest as is."""
    if size == 1:
        return state
    return {
        k: shard(k.rsplit("/", 1)[-1], v, size, rank) if np.ndim(v) > 0 else v
        for k, v in state.items()
    }


def slice_piece(name: str, value, size: int, rank: int):
    """A sharded checkpoint's piece for this rank's slice of split tensor `name` (the
    whole shape, ("tensor", rank, T), the elements), or None for a replicated one."""
    leaf = name.rsplit("/", 1)[-1]
    if size == 1 or np.ndim(value) == 0 or split_kind(leaf) is None:
        return None
    shape = full_shape(leaf, np.shape(value), size)
    return shape, ("tensor", rank, size), np.asarray(value).reshape(-1)


def range_piece(name: str, shape: tuple, first: int, elements, size: int, rank: int):
    """The piece for a flat range (a ZeRO shard) of this rank's slice of `name`, or for
    a replicated tensor's range ((shape, first, elements)) on tensor rank 0 alone (None
    on the others, which hold the same range)."""
    leaf = name.rsplit("/", 1)[-1]
    if size > 1 and len(shape) > 0 and split_kind(leaf):
        return full_shape(leaf, shape, size), ("tensor", rank, size, first), elements
    return (shape, first, elements) if rank == 0 else None


def unshard(name: str, pieces: list[np.ndarray]) -> np.ndarray:
    """The canonical array from every rank's piece, in tensor-rank order."""
    kind = split_kind(name)
    if kind is None or len(pieces) == 1:
        return np.array(pieces[0], copy=True)
    if kind == "qkv":
        thirds = [np.split(p, 3, axis=0) for p in pieces]
        return np.concatenate(
            [np.concatenate([t[j] for t in thirds], axis=0) for j in range(3)], axis=0
        )
    return np.concatenate(pieces, axis=0 if kind == "rows" else 1)


def check_divisible(opts: dict, size: int) -> str | None:
    """Why this transformer cannot be split over `size` ranks (None: it can)."""
    problems = []
    if opts["n_heads"] % size:
        problems.append(f"model.n_heads={opts['n_heads']}")
    if opts["d_ff"] % size:
        problems.append(f"model.d_ff={opts['d_ff']}")
    if problems:
        return (
            f"parallel.tensor={size}: {' and '.join(problems)} must be divisible by the "
            "tensor-parallel degree"
        )
    return None


def local_layers(layers: list, size: int) -> list:
    """The layer specs with this rank's shard shapes and the block's local head count."""
    if size == 1:
        return layers
    out = []
    for spec in layers:
        if spec.kind != "block":
            out.append(spec)
            continue
        local = copy.copy(spec)
        local.params = {k: local_shape(k, tuple(s), size) for k, s in spec.params.items()}
        local.attrs = {**spec.attrs, "n_heads": spec.attrs["n_heads"] // size, "tensor": size}
        out.append(local)
    return out


def full_shape(name: str, local: tuple, size: int) -> tuple:
    """The canonical shape of a tensor whose piece on each of `size` ranks is `local`."""
    kind = split_kind(name)
    if kind in ("qkv", "rows"):
        return (local[0] * size, *local[1:])
    if kind == "cols":
        return (local[0], local[1] * size)
    return tuple(local)


def local_shape(name: str, shape: tuple, size: int) -> tuple:
    """Each rank's piece shape of a canonical tensor of `shape` split over `size` ranks."""
    kind = split_kind(name)
    if kind in ("qkv", "rows"):
        return (shape[0] // size, *shape[1:])
    if kind == "cols":
        return (shape[0], shape[1] // size)
    return tuple(shape)
