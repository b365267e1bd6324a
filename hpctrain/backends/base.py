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

import numpy as np

OPTIMIZER_SLOTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}


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


class BackendBase:
    """Shared helpers; concrete backends live in torch.py and tensorflow.py."""

    name = "base"

    # Every backend provides:
    #   train_step(micro_batches: list[tuple[np.ndarray, np.ndarray]], lr: float) -> StepStats
    #   evaluate(x, y) -> EvalStats
    #   predict(x) -> np.ndarray (logits)
    #   get_weights() -> dict[str, np.ndarray]; set_weights(dict)
    #   export_state() -> dict[str, np.ndarray]; import_state(dict)
    #   rng_state() -> dict[str, np.ndarray]; set_rng_state(dict)
    #   average_buffers(); param_names() -> list[str]; versions() -> dict[str, str]

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


def cross_entropy_np(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-sample cross entropy in float64 numpy (reference for tests)."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    labels = labels.reshape(-1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels]
