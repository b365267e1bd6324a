"""The torch side of a parameter-server worker: numpy weights in, numpy gradients out.

A PS worker must not use Horovod (servers do the averaging), so this wraps only the
zoo model (`build_model` / ZooNet from backends/torch.py): load weights, compute the
mean gradient of one step's micro-batches, evaluate. Everything crosses as float32
numpy arrays under canonical names, so torch and TensorFlow workers are interchangeable.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from ..models import zoo
from .base import EvalStats
from .torch import build_model


class TorchWorker:
    """One zoo model on this rank; no optimizer (the servers own it)."""

    name = "torch"

    def __init__(self, cfg, inp: zoo.InputSpec, threads: int, rank: int = 0):
        torch.set_num_threads(threads)
        if cfg.train["deterministic"]:
            torch.use_deterministic_algorithms(True)
        seed = cfg.train["seed"]
        torch.manual_seed(seed + rank)
        np.random.seed((seed + rank) % 2**32)
        random.seed(seed + rank)
        self.model = build_model(cfg.model, inp, seed)
        self.params = OrderedDict(self.model.named_parameters())
        self.buffers = OrderedDict(self.model.named_buffers())

    def param_shapes(self) -> OrderedDict[str, tuple]:
        return OrderedDict((k, tuple(v.shape)) for k, v in self.params.items())

    @torch.no_grad()
    def set_params(self, arrays: dict[str, np.ndarray]) -> None:
        for k, p in self.params.items():
            p.copy_(torch.from_numpy(arrays[k]))

    def get_buffers(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v.detach().numpy().copy()) for k, v in self.buffers.items())

    @torch.no_grad()
    def set_buffers(self, arrays: dict[str, np.ndarray]) -> None:
        for k, b in self.buffers.items():
            b.copy_(torch.from_numpy(np.asarray(arrays[k], dtype=np.float32)))

    @staticmethod
    def _loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")

    def gradients(self, micro_batches) -> tuple[dict[str, np.ndarray], float, int, int]:
        """Mean gradient over all the step's samples, as numpy; plus loss sum, correct, count."""
        self.model.train()
        for p in self.params.values():
            p.grad = None
        total = sum(int(np.prod(y.shape)) for _, y in micro_batches)
        loss_sum, correct = 0.0, 0
        for x, y in micro_batches:
            xt, yt = torch.from_numpy(x), torch.from_numpy(y)
            logits = self.model(xt)
            loss = self._loss(logits, yt)
            (loss / total).backward()
            loss_sum += float(loss.detach())
            correct += int((logits.detach().argmax(-1) == yt).sum())
        grads = {k: p.grad.numpy() for k, p in self.params.items()}
        return grads, loss_sum, correct, total

    @torch.no_grad()
    def evaluate(self, x, y) -> EvalStats:
        self.model.eval()
        logits = self.model(torch.from_numpy(x))
        yt = torch.from_numpy(y)
        return EvalStats(
            float(self._loss(logits, yt)),
            int((logits.argmax(-1) == yt).sum()),
            int(np.prod(y.shape)),
        )

    def rng_state(self) -> dict[str, np.ndarray]:
        return {"torch": torch.get_rng_state().numpy().copy()}

    def set_rng_state(self, state: dict[str, np.ndarray]) -> None:
        if "torch" in state:
            torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))
