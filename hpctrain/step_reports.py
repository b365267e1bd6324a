"""Each step's global numbers and decisions, reduced while the next step computes.

Why: the gradient allreduce already makes every rank wait for the slowest one. A second
blocking allreduce per step, for the loss and the flags (NaN, preemption signal, a
time-based checkpoint), adds a second wait for the slower rank (`make bench` ablation:
96% vs 94% np=2 efficiency, within its noise). Here a step's small vector goes out with a
non-blocking MPI allreduce and is read one step later, when it has long arrived. Every
rank still acts on the same numbers at the same step; whatever must see the newest step
(a checkpoint, the end of an epoch, a preemption) calls `drain()` first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .runtime.comm import PendingArray, under_deadline

HEAD = ("loss_sum", "correct", "count", "nonfinite", "preempt", "save_due")


@dataclass
class StepReport:
    """The global view of one finished step (sums over ranks)."""

    step: int
    lr: float
    seconds: float  # this rank's wall time for the step
    comm_seconds: float  # this rank's time waiting for gradients
    local_nonfinite: bool  # this rank's own loss was NaN/inf
    totals: np.ndarray = field(repr=False)
    extra: dict = field(default_factory=dict)  # backend's extra metrics, mean over ranks

    @property
    def loss(self) -> float:
        return self.totals[0] / self.totals[2] if self.totals[2] else float("nan")

    @property
    def accuracy(self) -> float:
        return self.totals[1] / self.totals[2] if self.totals[2] else float("nan")

    @property
    def count(self) -> float:
        return self.totals[2]

    @property
    def loss_sum(self) -> float:
        return self.totals[0]

    @property
    def nonfinite(self) -> bool:
        return self.totals[3] > 0

    @property
    def preempt(self) -> bool:
        return self.totals[4] > 0

    @property
    def save_due(self) -> bool:
        return self.totals[5] > 0


class StepReducer:
    """At most one step's vector in flight; `push` returns the reports that settled."""

    def __init__(self, comm, overlap: bool = True, deferred: bool = False):
        """comm: the guarded communicator of the ranks whose steps are summed (the
        World, a grid axis), or None for a rank that reports alone (async workers).
        deferred: read each step's sums one push later (GPU ranks). One value for every
        rank of comm: decided per rank (say by whether its sums are tensors), ranks that
        hold no loss (pipeline stages but the last, tensor ranks but 0) would settle each
        step one push before the loss's owner, act on a flag at different steps and
        deadlock in the next collective."""
        self.world = comm
        self.overlap = overlap  # False: every push waits for its own step (one more sync)
        self.deferred = deferred
        self._pending = None  # (PendingArray, report without totals, extra layout)
        self._deferred = None  # a GPU step whose sums are read at the next push

    def push(self, step, stats, lr, seconds, preempt=False, save_due=False) -> list[StepReport]:
        """Send this step's numbers; return the previous step's report (if any), or this
        step's own when not overlapping.

        A GPU rank's step leaves its sums on the device (0-d tensors, see the torch
        backend): reading them waits for the step to finish, so with `deferred` they are
        read at the next push, once the next step's work is queued and the GPU never
        idles; a step's report then settles one push later. Otherwise read at once."""
        now = (step, stats, lr, seconds, preempt, save_due)
        if not self.deferred:
            settled = self.drain()
            self._send(*now)
        else:
            earlier, self._deferred = self._deferred, now
            settled = self._wait()
            if earlier is not None:
                self._send(*earlier)
        return settled if self.overlap else settled + self._wait()

    def _read_sums(self, step, stats) -> tuple[float, float]:
        """The step's loss sum and correct count. On a GPU rank float() waits for the
        step's device work, its NCCL collectives included: under the watchdog's deadline
        (runtime.collective_timeout), so a peer that stopped or hangs is named and the
        job ends, as in an MPI collective, before NCCL's own timeout (torch_pg)."""
        if not _on_device(stats):
            return float(stats.loss_sum), float(stats.correct)
        with under_deadline(self.world, f"step {step}'s device work"):
            return float(stats.loss_sum), float(stats.correct)

    def _send(self, step, stats, lr, seconds, preempt, save_due) -> None:
        loss_sum, correct = self._read_sums(step, stats)  # a device sum: see push
        bad = not np.isfinite(loss_sum)
        head = [
            0.0 if bad else loss_sum,
            correct,
            stats.count,
            float(bad),
            float(preempt),
            float(save_due),
        ]
        keys = sorted(stats.extra or {})
        parts = [np.atleast_1d(np.asarray(stats.extra[k], dtype=np.float64)) for k in keys]
        local = np.concatenate([np.asarray(head, dtype=np.float64), *parts])
        report = StepReport(step, lr, seconds, stats.comm_seconds, bad, totals=local)
        layout = [(k, p.size, isinstance(stats.extra[k], list)) for k, p in zip(keys, parts)]
        if self.world is None:
            pending = PendingArray(local)
        else:
            pending = self.world.start_allreduce_array(local, "sum", "step metrics")
        self._pending = (pending, report, layout)

    def drain(self) -> list[StepReport]:
        """Wait for the steps in flight (a deferred one included) and return their reports."""
        settled = self._wait()
        if self._deferred is not None:
            earlier, self._deferred = self._deferred, None
            self._send(*earlier)
            settled += self._wait()
        return settled

    def _wait(self) -> list[StepReport]:
        """Wait for the step whose allreduce is in flight (if any); its report."""
        if self._pending is None:
            return []
        pending, report, layout = self._pending
        self._pending = None
        flat = pending.wait()
        report.totals = flat[: len(HEAD)]
        i = len(HEAD)
        for key, size, is_list in layout:
            value = flat[i : i + size] / (self.world.size if self.world is not None else 1)
            report.extra[key] = [float(v) for v in value] if is_list else float(value[0])
            i += size
        return [report]


def _on_device(stats) -> bool:
    """The step's sums still live on an accelerator (anything but a Python/numpy number)."""
    return not isinstance(stats.loss_sum, (int, float, np.number))
