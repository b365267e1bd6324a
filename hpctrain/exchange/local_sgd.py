"""Local SGD (`train.sync_every: H`): ranks step on their own gradients and average
their parameters every H steps; post-local SGD (`train.local_sgd_warmup_steps: W`)
runs W ordinary synchronous steps first (Lin et al. 2020: the warm-up keeps the early,
fast-changing phase synchronous).

Traffic: one float32 allreduce of the parameters every H steps instead of one of the
gradients every step, so H times fewer bytes and latencies; per rank 2(N-1)/N x the
model, independent of N (1,024 or 4,096 ranks alike).
"""

from __future__ import annotations

import numpy as np


class LocalSchedule:
    """Which steps allreduce gradients, and after which steps parameters are averaged."""

    def __init__(self, every: int, warmup: int):
        self.every, self.warmup = int(every), int(warmup)

    def synchronous(self, step: int) -> bool:
        """Step `step` (0-based) averages its gradients (the warm-up)."""
        return step < self.warmup

    def average_after(self, step: int) -> bool:
        """Parameters are averaged after local step `step`."""
        return not self.synchronous(step) and (step - self.warmup + 1) % self.every == 0


class LocalSGDReducer:
    """Wraps the gradient reducer: it runs on warm-up steps only; local steps keep each
    rank's own gradients (nothing on the wire)."""

    def __init__(self, inner, schedule: LocalSchedule):
        self.inner, self.schedule = inner, schedule
        self.buffer, self.views, self.sizes = inner.buffer, inner.views, inner.sizes
        self._synced = False

    def reduce(self, step: int = 0) -> None:
        self._synced = self.schedule.synchronous(step)
        if self._synced:
            self.inner.reduce(step)

    def stats(self) -> dict[str, float]:
        return self.inner.stats() if self._synced else {"comm_bytes": 0.0, "compression_ratio": 1.0}

    def state(self) -> dict[str, np.ndarray]:
        return self.inner.state()

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.inner.load_state(state)


def average_weights(comm, weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """The mean over `comm` of every array in `weights` (one flat float32 allreduce) and
    the bytes this rank sent."""
    names = list(weights)
    flat = np.concatenate([np.asarray(weights[k], np.float32).reshape(-1) for k in names])
    comm.allreduce_inplace(flat, "sum", "local SGD: average the parameters")
    flat *= np.float32(1.0 / comm.size)
    out, at = {}, 0
    for k in names:
        shape = np.shape(weights[k])
        n = int(np.prod(shape))
        out[k] = flat[at : at + n].reshape(shape)
        at += n
    return out, 2 * (comm.size - 1) * flat.nbytes // comm.size
