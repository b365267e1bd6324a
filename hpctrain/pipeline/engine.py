"""Executing one stage's schedule: compute, receive and send in the schedule's order.

Framework-free: a stage object (torch_stage / tensorflow_stage) does the math, a
StageTransport moves the bytes. Receives run one micro-batch ahead of their use, so
while micro-batch i is computed the input of i+1 is already in flight; sends never
block. The time spent inside forward/backward is the stage's busy time; the rest of the
step (waiting for neighbours, draining sends) is its idle time, i.e. its bubble.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class StepTiming:
    busy: float  # seconds in forward/backward compute
    wall: float  # seconds from the first action to the last send leaving
    waited: float  # seconds blocked on receives and sends


def run_step(stage, link, actions, batch, micro: int, scale: float) -> StepTiming:
    """Run `actions` ([("F"|"B", i)]) for one optimizer step; gradients accumulate.

    `batch` holds the step's (x, y) micro-batches on the first and last stage (others
    pass None); `scale` is 1 / (loss terms of the step on this replica).
    """
    first, last = link.prev is None, link.next is None
    t_start, busy, waited0 = time.perf_counter(), 0.0, link.wait_seconds
    inputs: dict[int, np.ndarray] = {}
    link.post_activation(0)
    link.post_gradient(0)
    for kind, i in actions:
        if kind == "F":
            if first:
                x = batch[i][0]
            else:
                x = link.activation(i)
                inputs[i] = x
                if i + 1 < micro:
                    link.post_activation(i + 1)
            y = batch[i][1] if last else None
            t0 = time.perf_counter()
            out = stage.forward(i, x, y, scale)
            busy += time.perf_counter() - t0
            if not last:
                link.send_activation(i, out)
        else:
            grad = None
            if not last:
                grad = link.gradient(i)
                if i + 1 < micro:
                    link.post_gradient(i + 1)
            t0 = time.perf_counter()
            grad_in = stage.backward(i, grad)
            busy += time.perf_counter() - t0
            if not first:
                # the upstream buffer passed straight through (a tensor stage copies it)
                host = isinstance(grad_in, np.ndarray) and grad is not None
                if host and np.shares_memory(grad_in, grad):
                    grad_in = grad_in.copy()
                link.send_gradient(i, grad_in)
                link.release(inputs.pop(i))
        link.progress()
    link.flush()
    return StepTiming(busy, time.perf_counter() - t_start, link.wait_seconds - waited0)


def run_inference(stage, link, batches, n_batches: int, batch_size: int):
    """Eval-mode forward of `n_batches` batches through the pipeline (streams naturally).

    The first stage pads short batches to `batch_size` (the agreed message shape); the
    last stage returns its logits trimmed back, one array per batch; others return [].
    """
    first, last = link.prev is None, link.next is None
    outputs = []
    it = iter(batches) if batches is not None else None
    for _ in range(n_batches):
        n_valid = batch_size
        if first:
            x = next(it)[0]
            n_valid = len(x)
            if n_valid < batch_size:
                pad = np.zeros((batch_size - n_valid, *x.shape[1:]), dtype=x.dtype)
                x = np.concatenate([x, pad])
        else:
            x = link.activation(0)
        out = stage.infer(x)
        if last:
            outputs.append(out)
        else:
            link.send_activation(0, np.ascontiguousarray(out, dtype=np.float32))
        if not first:
            link.release(x)  # after the send: a reshape-only stage sends a view of x
        link.progress()
    link.flush()
    return outputs


def chunk_batches(stages: int) -> int:
    """Validation batches between two stop checks: the pipeline drains at each check (a
    bubble of stages - 1 batches' forwards), so 8 x stages keeps it under 1/9 of the
    evaluation while a signal waits at most that many forwards."""
    return 8 * stages


def run_inference_stoppable(stage, link, batches, n_batches: int, batch_size: int, stop, chunk):
    """`run_inference` in chunks of `chunk` batches, asking `stop()` (a collective every
    rank calls as often: n_batches is the same on every rank) before each: None once it
    says stop, else the last stage's logits per batch."""
    it = iter(batches) if batches is not None else None
    outputs, done = [], 0
    while done < n_batches:
        if stop is not None and stop():
            return None
        k = min(chunk, n_batches - done)
        outputs += run_inference(stage, link, it, k, batch_size)
        done += k
    return outputs
