"""A worker rank: pull parameters, compute a gradient on its shard of the data, push it.

Each step pushes one message per server (its slices of the gradient, with the version
of the parameters it was computed on) and receives one reply per server (that server's
current parameters and version): push and pull in one round trip. The framework part
(model, gradients, evaluation) is a `TorchWorker` or `TensorFlowWorker`; no Horovod.

A background thread sends a heartbeat to every server while the worker computes, so a
slow step is not mistaken for a dead worker.

Test-only hooks (environment variables, `worker:value`): HPCTRAIN_PS_TEST_DELAY sleeps
that many seconds before every push, HPCTRAIN_PS_TEST_SLOW makes each step `value`
times as long, HPCTRAIN_PS_TEST_STOP makes the worker go silent from that step on.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from . import protocol as P

log = logging.getLogger("hpctrain.ps")


def test_hook(name: str, worker: int) -> float | None:
    """The value of hook `name` for this worker, if set ("worker:value")."""
    raw = os.environ.get(name, "")
    if ":" not in raw:
        return None
    w, value = raw.split(":", 1)
    return float(value) if int(w) == worker else None


class Worker:
    def __init__(
        self, world, index, servers, plan, model, data, cfg, total_steps, on_step,
        start=(0, 0, 0), wants_save=None, preemption=None, on_checkpoint=None,
    ):  # fmt: skip
        """start: (step, epoch, position) to continue from; wants_save(step, epoch_end)
        is this worker's view of the checkpoint policy; on_checkpoint(worker) is the
        collective save every rank joins when a reply carries FLAG_SAVE."""
        self.world, self.comm, self.MPI = world, world.comm, world.MPI
        self.index, self.servers, self.plan = index, servers, plan
        self.model, self.data, self.cfg = model, data, cfg
        self.total_steps, self.on_step = total_steps, on_step
        self.wants_save, self.preemption = wants_save, preemption
        self.on_checkpoint = on_checkpoint
        self.epoch, self.position = int(start[1]), int(start[2])
        self.flags = 0  # H_FLAGS of the last replies (OR over servers)
        self.preempted = False
        pcfg = cfg.ps
        self.timeout = float(pcfg["heartbeat_timeout"])
        self.backoff = P.Backoff(float(pcfg["poll_max_sleep_ms"]) / 1000.0)
        sizes = [plan.server_size(s) for s in range(len(servers))]
        self.push = [P.Message(n) for n in sizes]
        self.reply = [P.Message(n) for n in sizes]
        self.weights = {k: np.zeros(v, np.float32) for k, v in plan.shapes.items()}
        self.versions = [0] * len(servers)
        self.stop_at = test_hook("HPCTRAIN_PS_TEST_STOP", index)
        self.delay = test_hook("HPCTRAIN_PS_TEST_DELAY", index) or 0.0
        self.slow = test_hook("HPCTRAIN_PS_TEST_SLOW", index) or 1.0
        self._beat_stop = threading.Event()
        self.stats = {
            "worker": index,
            "rank": world.rank,
            "backend": model.name,
            "steps": int(start[0]),
            "samples": 0,
            "rejected": 0,
            "compute_seconds": 0.0,
            "wait_seconds": 0.0,
            "stopped_by_test_hook": False,
            "stopped_by_server": False,
        }

    # --- heartbeats -----------------------------------------------------------------
    def _beat(self) -> None:
        interval = max(0.05, self.timeout / 4)
        while not self._beat_stop.wait(interval):
            for rank in self.servers:
                self.comm.Send(P.ctrl(P.HEARTBEAT, self.index), dest=rank, tag=P.TAG_CTRL)

    # --- exchanges ------------------------------------------------------------------
    def _exchange(self, push: bool) -> list[int]:
        """Send a push (or a pull request) to every server and wait for every reply."""
        reqs = [
            self.comm.Irecv(m.buf, source=r, tag=P.TAG_REPLY)
            for m, r in zip(self.reply, self.servers)
        ]
        for s, r in enumerate(self.servers):
            if push:
                h = self.push[s].header
                h[P.H_WORKER], h[P.H_VERSION], h[P.H_STEP] = (
                    self.index,
                    self.versions[s],
                    self.stats["steps"],
                )
                h[P.H_FLAGS] = self._wishes()
                reqs.append(self.comm.Isend(self.push[s].buf, dest=r, tag=P.TAG_PUSH))
            else:
                reqs.append(self.comm.Isend(P.ctrl(0, self.index), dest=r, tag=P.TAG_PULL))
        limit = 2 * self.timeout + 10
        if not P.wait_all(self.MPI, reqs, self.backoff, time.monotonic() + limit):
            late = [self.servers[s] for s in range(len(self.servers)) if not reqs[s].Test()]
            self.world.abort(
                f"worker {self.index}: no reply from parameter server rank(s) {late} within "
                f"{limit:.0f} s: a server died or hangs, ending the job"
            )
        statuses = []
        self.flags = 0
        for s, m in enumerate(self.reply):
            statuses.append(int(m.header[P.H_STATUS]))
            self.flags |= int(m.header[P.H_FLAGS])
            self.versions[s] = int(m.header[P.H_VERSION])
            self.plan.scatter(s, m.payload, self.weights)
        self.model.set_params(self.weights)
        return statuses

    def run(self) -> dict:
        beat = threading.Thread(target=self._beat, name="hpctrain-ps-heartbeat", daemon=True)
        beat.start()
        st = self.stats
        t_start = time.perf_counter()
        try:
            self._exchange(push=False)
            self._loop(st)
        finally:
            self._beat_stop.set()
            beat.join()
        if not st["stopped_by_test_hook"]:
            for r in self.servers:
                self.comm.Send(P.ctrl(P.DONE, self.index), dest=r, tag=P.TAG_CTRL)
        st["seconds"] = time.perf_counter() - t_start
        st["samples_per_sec"] = st["samples"] / st["seconds"] if st["seconds"] > 0 else None
        return st

    def _wishes(self) -> int:
        """H_FLAGS of the next push: a checkpoint due after it, a preemption signal."""
        flags = 0
        nxt = self.stats["steps"] + 1
        if self.wants_save is not None and self.wants_save(
            nxt, self.data.steps_left(self.position + self.data.global_batch) == 0
        ):
            flags |= P.FLAG_SAVE
        if self.preemption is not None and self.preemption.requested:
            flags |= P.FLAG_PREEMPT
        return flags

    def _loop(self, st: dict) -> None:
        while st["steps"] < self.total_steps:
            epoch, position = self.epoch, self.position
            for micro in self.data.iterate(epoch, position):
                if self.stop_at is not None and st["steps"] >= self.stop_at:
                    st["stopped_by_test_hook"] = True
                    log.warning("worker %d: test hook stops it at step %d", self.index, st["steps"])
                    self._beat_stop.set()
                    return
                t0 = time.perf_counter()
                grads, loss_sum, correct, count = self.model.gradients(micro)
                for s, m in enumerate(self.push):
                    self.plan.gather(s, grads, m.payload)
                compute = time.perf_counter() - t0
                if self.delay or self.slow != 1.0:
                    time.sleep(self.delay + (self.slow - 1.0) * compute)
                t1 = time.perf_counter()
                statuses = self._exchange(push=True)
                st["wait_seconds"] += time.perf_counter() - t1
                st["compute_seconds"] += compute
                st["steps"] += 1
                self.position += self.data.global_batch
                if self.data.steps_left(self.position) == 0:
                    self.epoch, self.position = epoch + 1, 0
                st["samples"] += count
                st["rejected"] += sum(x == P.REJECTED for x in statuses)
                self.on_step(self, loss_sum / count, correct / count, time.perf_counter() - t0)
                if P.STOPPED in statuses:
                    st["stopped_by_server"] = True
                    log.warning("worker %d: a server dropped it; stopping", self.index)
                    return
                if self.flags & P.FLAG_PREEMPT:
                    # every worker stops after this step; the run saves at its end
                    self.preempted = True
                    return
                if self.flags & P.FLAG_SAVE and self.on_checkpoint is not None:
                    self.on_checkpoint(self)
                if st["steps"] >= self.total_steps:
                    return
            if self.epoch == epoch:  # the epoch ended without a full last batch
                self.epoch, self.position = epoch + 1, 0
