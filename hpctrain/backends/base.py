"""The small interface every framework backend implements (framework-free).

The trainer, the checkpoint module and the strategies only ever talk to a backend
through these methods, exchanging numpy arrays under canonical names:

- `model/<name>` for parameters and buffers (`<layer>.<param>`, torch's layouts);
- `optimizer/<slot>/<name>` for per-parameter optimizer state, slots named as torch's
  optimizers name them (`momentum_buffer`, `exp_avg`, `exp_avg_sq`);
- `optimizer/step` for the optimizer's step counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import ConfigError, HpctrainError
from ..models import zoo
from ..moe.parallel import is_expert_param, require_group
from ..tensor import parallel as tensor_parallel

OPTIMIZER_SLOTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}


def replicated_memory_plan(trainable: int, reducer, slots: int, optimizer_now: float) -> dict:
    """memory_plan() without ZeRO: a gradient per trainable byte plus the engine's flat
    buffer (allocated, not yet touched), and `slots` optimizer states per trainable byte."""
    buffer = getattr(reducer, "buffer", None)
    return {
        "grad": float(trainable + (buffer.nbytes if buffer is not None else 0)),
        "grad_now": 0.0,
        "optimizer": float(slots * trainable),
        "optimizer_now": optimizer_now,
    }


@dataclass
class StepStats:
    """What one optimizer step did on this rank (sums, so ranks can be added up)."""

    loss_sum: float  # summed per-sample (per-token) loss over the step's samples
    correct: int
    count: int  # samples (tokens for language models)
    comm_seconds: float  # time spent waiting for the gradient allreduce
    # Optional strategy metrics (numbers or lists of numbers, the same keys on every
    # rank, e.g. MoE load): the trainer averages them over ranks into metrics.jsonl.
    extra: dict = field(default_factory=dict)


@dataclass
class EvalStats:
    loss_sum: float
    correct: int
    count: int


class Backend(Protocol):
    """A data-parallel replica of the whole model (torch.py, tensorflow.py)."""

    engine: str  # who averages gradients: "horovod" | "mpi" | "overlap" | "nccl" | "gloo"
    engine_reason: str
    exchange_step: int  # optimizer steps taken (reducers' warm-up, local SGD phases)

    def train_step(self, micro_batches: list, lr: float, tally: bool = True) -> StepStats: ...
    # tally=False: the step need not count correct predictions (its `correct` is then
    # NaN, or counted anyway where that is free): the loop reads them on logged steps
    # only, and the argmax over the logits is ~1% of a GPU step (H100, 135 M model)
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalStats: ...
    def predict(self, x: np.ndarray) -> np.ndarray: ...
    def average_buffers(self) -> None: ...
    def param_names(self) -> list[str]: ...
    def get_weights(self) -> dict[str, np.ndarray]: ...
    def set_weights(self, weights: dict[str, np.ndarray]) -> None: ...
    def weight_shapes(self) -> dict[str, tuple]: ...
    # staged=True (an async save's): the arrays may still be filling (a GPU rank's copy
    # beside the next step) until `wait_exported()` returns, on the thread that reads
    def export_state(self, staged: bool = False) -> dict[str, np.ndarray]: ...
    def wait_exported(self) -> None: ...
    # True: export_state's arrays stay untouched until `fence()` (called here before
    # the backend changes them), so an async checkpoint copies them during the next
    # step; False: they are copied before the step goes on
    def hold_exported_state(self, fence) -> bool: ...
    def import_state(self, state: dict[str, np.ndarray]) -> None: ...
    def rng_state(self) -> dict[str, np.ndarray]: ...
    def set_rng_state(self, state: dict[str, np.ndarray]) -> None: ...
    def versions(self) -> dict[str, str]: ...
    def memory_plan(self) -> dict[str, float]: ...  # bytes per rank, before any compute
    # ZeRO: (this rank's local state, what it owns of the sharded optimizer state)
    def export_owned_state(self) -> tuple[dict[str, np.ndarray], dict]: ...
    def wrap_reducer(self, wrap) -> None: ...  # BackendBase
    def reducer_state(self) -> dict[str, np.ndarray]: ...  # BackendBase
    def load_reducer_state(self, arrays: dict[str, np.ndarray]) -> None: ...  # BackendBase


class Stage(Protocol):
    """One pipeline stage: a contiguous slice of the zoo's layers (torch_stage.py,
    tensorflow_stage.py)."""

    peak_stash: int

    def attach_mpi(self, replicas, transport=None) -> None: ...
    def attach_replicas(self, hvd, process_set, replicas=None) -> None: ...
    def attach_zero(self, replicas, bucket_bytes: int, transport=None) -> None: ...
    def forward(self, micro: int, x: np.ndarray, y: np.ndarray | None, scale: float): ...
    def backward(self, micro: int, grad: np.ndarray | None): ...
    def average_grads(self) -> float: ...
    def grad_square_sum(self) -> float: ...
    def grad_square_sums(self, is_split) -> tuple[float, float]: ...  # (split, replicated)
    def apply(self, lr: float, clip_coef: float = 1.0) -> None: ...
    def take_stats(self) -> tuple[float, int]: ...
    def infer(self, x: np.ndarray) -> np.ndarray: ...
    def average_buffers(self) -> None: ...
    def tally_step(self, tally: bool) -> None: ...  # count the next step's correct ones?
    def read_later(self, stats): ...  # the step's sums, readable on the host
    def moe_metrics(self, step_seconds: float) -> dict: ...  # its MoE layers' ({}: none)
    def memory_plan(self) -> dict[str, float]: ...  # once built: state still to come
    def peak_memory(self) -> tuple[float, str]: ...  # (bytes, what measures them)
    def get_weights(self) -> dict[str, np.ndarray]: ...
    def set_weights(self, weights: dict[str, np.ndarray]) -> None: ...
    def export_state(self) -> dict[str, np.ndarray]: ...
    def export_owned(self) -> tuple[dict, dict]: ...  # ZeRO-1: (local state, owned slots)
    def import_state(self, state: dict[str, np.ndarray]) -> None: ...
    def rng_state(self) -> dict[str, np.ndarray]: ...
    def set_rng_state(self, state: dict[str, np.ndarray]) -> None: ...


class Worker(Protocol):
    """A parameter-server worker's model: gradients only, no optimizer, no Horovod
    (torch_worker.py, tensorflow_worker.py)."""

    name: str

    def param_shapes(self) -> dict[str, tuple]: ...
    def set_params(self, arrays: dict[str, np.ndarray]) -> None: ...
    def get_buffers(self) -> dict[str, np.ndarray]: ...
    def set_buffers(self, arrays: dict[str, np.ndarray]) -> None: ...
    def gradients(self, micro_batches) -> tuple[dict[str, np.ndarray], float, int, int]: ...
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalStats: ...
    def rng_state(self) -> dict[str, np.ndarray]: ...
    def set_rng_state(self, state: dict[str, np.ndarray]) -> None: ...


PROTOCOLS = {"backend": Backend, "stage": Stage, "worker": Worker}


class BackendBase:
    """Shared helpers; the concrete backends (torch.py, tensorflow.py) implement `Backend`."""

    name = "base"

    def hold_exported_state(self, fence) -> bool:
        """False: export_state's arrays are copied before training goes on (see Backend)."""
        return False

    def wait_exported(self) -> None:
        """Nothing to wait for: export_state's arrays hold their values on return."""

    # The MPI engine's gradient reducer, which both backends keep in `_flat`, behind
    # three narrow methods: nobody else touches the field.
    def wrap_reducer(self, wrap) -> None:
        """Replace the gradient reducer by `wrap(reducer)` (local SGD wraps it)."""
        self._flat = wrap(self._flat)

    def reducer_state(self) -> dict[str, np.ndarray]:
        """The reducer's per-rank memory (error-feedback residuals, PowerSGD factors);
        {} for the dense engines, Horovod and ZeRO."""
        state = getattr(getattr(self, "_flat", None), "state", None)
        return state() if state is not None else {}

    def load_reducer_state(self, arrays: dict[str, np.ndarray]) -> None:
        self._flat.load_state(arrays)

    def check_weights(self, weights: dict[str, np.ndarray], expected: dict[str, tuple]) -> None:
        """Raise ValueError listing missing, unexpected and wrongly-shaped weights."""
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        shapes = [
            f"{k}: file {tuple(weights[k].shape)} vs model {tuple(expected[k])}"
            for k in sorted(set(weights) & set(expected))
            if tuple(weights[k].shape) != tuple(expected[k])
        ]
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if extra:
                parts.append(f"unexpected {extra}")
            if shapes:
                parts.append(f"shape mismatch {shapes}")
            raise ValueError("weights do not match the model: " + "; ".join(parts))


def build_agreed(world, build):
    """`build()` on every rank; a user error (HpctrainError: a module missing on one node,
    a model whose output does not fit the classes) on any rank stops every rank with one
    message naming the ranks, before the first collective that would leave them waiting."""
    model, error = None, None
    try:
        model = build()
    except HpctrainError as exc:
        error = str(exc)
    if world is not None and world.size > 1:
        world.agree(error, error_type=ConfigError)
    elif error is not None:
        raise ConfigError(error)
    return model


def split_square_sums(
    names: list[str], squares, is_split, zero=None, experts=None
) -> tuple[float, float]:
    """(split, replicated) sums of squares of a model's (or pipeline stage's) gradients,
    for a clip by the whole model's norm: `squares()` gives one float per name;
    tensor-parallel slices (`is_split(name)`) apart, for the caller to sum over the
    tensor axis; MoE experts, each on one rank of its group, summed over the group and
    counted with the replicated ones (`experts`: their group). Under ZeRO from the
    replicas' shards of the averaged gradient."""
    if zero is not None:
        mask = zero.part.shard_mask({i for i, n in enumerate(names) if is_split(n)})
        return zero.part.square_sums(zero.shard_grad, mask)
    sums = [0.0, 0.0, 0.0]
    for name, sq in zip(names, squares(), strict=True):
        sums[2 if is_expert_param(name) else (0 if is_split(name) else 1)] += sq
    if any(is_expert_param(n) for n in names):
        sums[1] += require_group(experts).allreduce_sum(sums[2])
    return sums[0], sums[1]


def model_part(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `model/<name>` entries of a canonical state, without the prefix."""
    return {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}


def with_model_prefix(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"model/{k}": v for k, v in weights.items()}


def cross_entropy_np(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-sample cross entropy in float64 numpy (reference for tests)."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    labels = labels.reshape(-1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels]


def init_stream(model_cfg: dict, inp: zoo.InputSpec, seed: int, groups, keys):
    """(name, this rank's initial value) of a zoo model's tensors in `keys`, one tensor
    at a time (layers_init_stream of its layers)."""
    layers = zoo.build_layers(model_cfg, inp)
    return layers_init_stream(layers, seed, groups.tensor, keys)


def layers_init_stream(layers, seed: int, tp, keys):
    """(name, this rank's initial value) of the tensors in `keys` of a layer sequence,
    one tensor at a time, drawn in the whole sequence's order: the values of one
    process (all experts drawn, the same at any world size, of which this rank keeps
    its own), and this rank's piece (`tp`: its tensor group) of each split tensor."""
    for key, value in zoo.iter_init_weights(layers, seed):
        if key in keys:
            yield (
                key,
                value if tp.size == 1 else tensor_parallel.shard(key, value, tp.size, tp.rank),
            )
        del value
