"""The torch side of a parameter-server worker: numpy weights in, numpy gradients out.

A PS worker must not use Horovod (servers do the averaging), so this wraps only the
zoo model (`build_model` / ZooNet from backends/torch.py): load weights, compute the
mean gradient of one step's micro-batches, evaluate. Everything crosses as float32
numpy arrays under canonical names, so torch and TensorFlow workers are interchangeable.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..models import zoo
from .base import EvalStats
from .torch_model import build_model
from .torch_steps import (
    backward_mean_loss,
    evaluate_model,
    prepare_process,
    rng_state,
    set_rng_state,
)
from .worker_base import WorkerBase


class TorchWorker(WorkerBase):
    """One zoo model on this rank; no optimizer (the servers own it)."""

    name = "torch"
    prepare_process = staticmethod(prepare_process)

    def build(self, model_cfg: dict, inp: zoo.InputSpec, seed: int, groups) -> None:
        self.model = build_model(model_cfg, inp, seed, groups)
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

    def gradients(self, micro_batches) -> tuple[dict[str, np.ndarray], float, int, int]:
        """Mean gradient over all the step's samples, as numpy; plus loss sum, correct, count."""
        self.model.train()
        for p in self.params.values():
            p.grad = None
        loss_sum, correct, total = backward_mean_loss(self.model, micro_batches)
        grads = {k: p.grad.numpy() for k, p in self.params.items()}
        return grads, loss_sum, correct, total

    def evaluate(self, x, y) -> EvalStats:
        return evaluate_model(self.model, x, y)

    rng_state = staticmethod(rng_state)
    set_rng_state = staticmethod(set_rng_state)
