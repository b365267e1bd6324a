"""A worker rank: pull parameters, compute a gradient on its shard of the data, push it.

Each step pushes one message per server (its slices of the gradient, with the version
of the parameters it was computed on) and receives one reply per server (that server's
current parameters and version): push and pull in one round trip. The framework part
(model, gradients, evaluation) is a `TorchWorker` or `TensorFlowWorker`; no Horovod.

A background thread sends a heartbeat to every server while the worker computes, so a
slow step is not mistaken for a dead worker. The training loop (hpctrain/loop.py)
drives it: `start()`, then one `step()` per batch, then `stop()`. Faults for tests
(a slow or silent worker) come in as `faults` (hpctrain/runtime/faults.py).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ...runtime import p2p
from ...runtime.clock import Stopwatch
from ...runtime.faults import NO_FAULTS, Faults
from . import protocol as P

log = logging.getLogger("hpctrain.ps")


class Worker:
    def __init__(
        self, world, index, servers, plan, model, data, cfg, start_step=0, position=0,
        wants_save=None, preemption=None, faults: Faults = NO_FAULTS,
    ):  # fmt: skip
        """wants_save(step, epoch_end) is this worker's view of the checkpoint policy;
        its wishes and a preemption signal travel to the servers in the push headers.
        faults: a test's silent, delayed or slow worker (none by default)."""
        self.world, self.comm, self.MPI = world, world.comm, world.MPI
        self.index, self.servers, self.plan = index, servers, plan
        self.model, self.data, self.cfg = model, data, cfg
        self.wants_save, self.preemption = wants_save, preemption
        self.sync = cfg.ps["mode"] == "sync"
        # a checkpoint of an epoch's last step holds the epoch's end: the loop starts
        # the next epoch, and so does this count (else its epoch ends go unseen)
        self.position = int(position)
        if data is not None and data.steps_left(self.position) <= 0:  # None: a bench's
            self.position = 0
        self.flags_bits = 0  # H_FLAGS of the last replies (OR over servers)
        pcfg = cfg.ps
        self.timeout = float(pcfg["heartbeat_timeout"])
        self.backoff = P.Backoff(float(pcfg["poll_max_sleep_ms"]) / 1000.0)
        sizes = [plan.server_size(s) for s in range(len(servers))]
        self.push = [P.Message(n) for n in sizes]
        self.reply = [P.Message(n) for n in sizes]
        self.weights = {k: np.zeros(v, np.float32) for k, v in plan.shapes.items()}
        self.versions = [0] * len(servers)
        self.silent_from = faults.value("ps_silent", index)
        self.delay = faults.value("ps_delay", index) or 0.0
        self.slow = faults.value("ps_slow", index) or 1.0
        self._beat_stop = threading.Event()
        self.stats = {
            "worker": index,
            "rank": world.rank,
            "backend": model.name,
            "steps": int(start_step),
            "samples": 0,
            "rejected": 0,
            "compute_seconds": 0.0,
            "wait_seconds": 0.0,
            "silent": False,
            "stopped_by_server": False,
        }

    # --- heartbeats -----------------------------------------------------------------
    def _beat_loop(self) -> None:
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
        self.flags_bits = 0
        for s, m in enumerate(self.reply):
            statuses.append(int(m.header[P.H_STATUS]))
            self.flags_bits |= int(m.header[P.H_FLAGS])
            self.versions[s] = int(m.header[P.H_VERSION])
            self.plan.scatter(s, m.payload, self.weights)
        self.model.set_params(self.weights)
        return statuses

    def start(self) -> None:
        """Heartbeats on, and the servers' current parameters pulled."""
        self._beat = threading.Thread(
            target=self._beat_loop, name="hpctrain-ps-heartbeat", daemon=True
        )
        self._beat.start()
        self._stopwatch = Stopwatch(self.world.watchdog.clock)  # a suspension left out
        self._exchange(push=False)

    def stop(self) -> dict:
        """Heartbeats off; tell the servers this worker is done. Returns its statistics."""
        self._beat_stop.set()
        self._beat.join()
        st = self.stats
        if not st["silent"]:
            for r in self.servers:
                self.comm.Send(P.ctrl(P.DONE, self.index), dest=r, tag=P.TAG_CTRL)
        st["seconds"] = self._stopwatch.elapsed()
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

    def step(self, micro) -> tuple[float, int, int, float]:
        """One push/pull round with this batch's gradient: (loss_sum, correct, count,
        seconds waiting for the servers). Sets `preempted`/`stopped` from the replies."""
        st = self.stats
        if self.silent_from is not None and st["steps"] >= self.silent_from:
            st["silent"] = True  # a fault: the worker stops talking, heartbeats too
            self._beat_stop.set()
            log.warning("worker %d: silent from step %d (fault injection)", self.index, st["steps"])
            return 0.0, 0, 0, 0.0
        t0 = self._stopwatch.elapsed()
        grads, loss_sum, correct, count = self.model.gradients(micro)
        for s, m in enumerate(self.push):
            self.plan.gather(s, grads, m.payload)
        compute = max(0.0, self._stopwatch.elapsed() - t0)
        if self.delay or self.slow != 1.0:
            time.sleep(self.delay + (self.slow - 1.0) * compute)
        t1 = self._stopwatch.elapsed()  # a suspension in the exchange is not a wait
        statuses = self._exchange(push=True)
        wait = max(0.0, self._stopwatch.elapsed() - t1)
        st["wait_seconds"] += wait
        st["compute_seconds"] += compute
        st["steps"] += 1
        self.position += self.data.global_batch
        if self.data.steps_left(self.position) <= 0:
            self.position = 0
        st["samples"] += count
        st["rejected"] += sum(x == P.REJECTED for x in statuses)
        if P.STOPPED in statuses:
            st["stopped_by_server"] = True
            log.warning("worker %d: a server dropped it; stopping", self.index)
        return loss_sum, correct, count, wait

    def flags(self) -> dict:
        """What the servers agreed in this step's replies: in sync mode the same for every
        worker; in async mode a save asked goes ahead once server 0 says so."""
        bits, st = self.flags_bits, self.stats
        stop = st["silent"] or st["stopped_by_server"]
        save = bool(bits & P.FLAG_SAVE) and not bits & P.FLAG_PREEMPT and not stop
        if save and not self.sync:
            save = self._save_goes_ahead()
        return {"preempt": bool(bits & P.FLAG_PREEMPT), "save": save, "stop": stop}

    def _save_goes_ahead(self) -> bool:
        """Async: tell server 0 this worker stopped after its step, and wait for its
        word: GO once every worker has (the slowest one's step), CANCEL if one finished,
        was dropped or a preemption came. Heartbeats go on meanwhile. The wait has no
        deadline of its own while every rank answers the watchdog's liveness probe (a
        worker's step may be long, that is what async is for; a silent worker is
        dropped by the servers, which calls the save off)."""
        first = self.servers[0]
        answer = np.zeros(8, np.int64)
        req = self.comm.Irecv(answer, source=first, tag=P.TAG_SAVE)
        self.comm.Send(P.ctrl(P.SAVE_READY, self.index), dest=first, tag=P.TAG_CTRL)
        what = (
            f"parameter server: worker {self.index} waits for every worker to end its "
            "step before a checkpoint"
        )
        p2p.wait_while_every_rank_answers(self.world, [req], what, self.backoff)
        return int(answer[0]) == P.GO
