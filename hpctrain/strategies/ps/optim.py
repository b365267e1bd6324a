"""Server-side optimisers in numpy with torch's exact update rules (SGD, Adam).

Servers import no framework, so the rules of `torch.optim.SGD` / `torch.optim.Adam`
(single-tensor CPU path; the same ones `_Optimizer` in backends/tensorflow.py writes in
tf ops) are spelled out here on one flat float32 vector per server. Every array stays
float32 and the scalar factors are rounded as torch rounds them, so a PS run in sync
mode reproduces data-parallel training to float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np

from ...backends.base import OPTIMIZER_SLOTS

F32 = np.float32


class FlatOptimizer:
    """Optimizer state for one flat parameter vector (updated in place)."""

    def __init__(self, ocfg: dict, params: np.ndarray):
        self.kind = ocfg["name"]
        self.momentum = float(ocfg["momentum"])
        self.wd = float(ocfg["weight_decay"])
        self.b1, self.b2 = (float(b) for b in ocfg["betas"])
        self.eps = float(ocfg["eps"])
        self.params = params
        self.slots = {s: np.zeros_like(params) for s in OPTIMIZER_SLOTS[self.kind]}
        self.step = 0  # updates applied (torch's per-parameter `step`, shared here)

    def apply(self, grad: np.ndarray, lr: float) -> None:
        """One update with gradient `grad` (float32, same size as the params)."""
        p = self.params
        self.step += 1
        if self.wd:
            grad = grad + F32(self.wd) * p
        if self.kind == "sgd":
            if self.momentum:
                buf = self.slots["momentum_buffer"]
                if self.step == 1:
                    buf[...] = grad  # torch: the buffer starts as a clone of the gradient
                else:
                    buf *= F32(self.momentum)
                    buf += grad
                grad = buf
            p += F32(-lr) * grad
            return
        m, v = self.slots["exp_avg"], self.slots["exp_avg_sq"]
        m += F32(1 - self.b1) * (grad - m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v *= F32(self.b2)
        v += F32(1 - self.b2) * grad * grad
        bc1 = 1 - self.b1**self.step
        bc2_sqrt = math.sqrt(1 - self.b2**self.step)
        denom = np.sqrt(v) / F32(bc2_sqrt)
        denom += F32(self.eps)
        p += F32(-lr / bc1) * m / denom

    def state(self) -> dict[str, np.ndarray]:
        """Slots by torch's names (flat) plus the step counter."""
        out = {k: v.copy() for k, v in self.slots.items()}
        out["step"] = np.array(self.step, dtype=np.int64)
        return out

    def load(self, state: dict[str, np.ndarray]) -> None:
        for k in self.slots:
            self.slots[k][...] = state[k]
        self.step = int(state["step"])
