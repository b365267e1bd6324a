"""A server rank: owns one shard of the parameters and its optimizer state, serves workers.

It posts one persistent receive per worker and message kind (push, pull, control) and
services whichever completes (`Testsome` with a sleeping backoff, see protocol.py), so
one server serves any number of workers without spinning a core. Each reply carries the
server's version, which advances by one per applied update:

- sync: a version advances when every live worker's gradient computed on it has arrived;
  the update uses their average (the mean over the global batch: data-parallel SGD);
- async: every gradient is applied as it arrives;
- bounded: a gradient computed on parameters `s` versions old is scaled by
  1/(1 + decay*s), or rejected (counted, and answered with the current parameters so the
  worker re-pulls) when s > bound.

A worker that sends nothing (no push, pull or heartbeat) for `heartbeat_timeout` seconds
is dropped: async and bounded continue with the others, sync ends the job.

Checkpoints in sync mode are taken at a version every worker pushed for. In async and
bounded mode there is no such version: worker 0's wish (its own step count, the
`checkpoint:` policy) makes server 0 ask every worker, in its replies, to stop after its
current step; once all have answered, server 0 tells every worker and server to save, each
at its own step (the checkpoint keeps each worker's). The fast workers wait for the
slowest one's step, once per save. A worker finished or dropped, or a preemption, calls
the save off (the run saves at its end). Cost on server 0: one control message in and
one out per worker a save, O(workers): ~1,000 or ~4,000 64-byte messages at 1,024 or
4,096 workers, beside the model's bytes each worker pushes every step.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ...runtime.clock import Stopwatch
from . import protocol as P
from .optim import FlatOptimizer

log = logging.getLogger("hpctrain.ps")


class Server:
    def __init__(
        self, world, index: int, workers: list[int], params: np.ndarray, cfg, lr_of,
        preemption=None, on_checkpoint=None, servers: list[int] | None = None,
    ):  # fmt: skip
        """preemption: a Preemption (its signal is passed on to the workers in H_FLAGS);
        on_checkpoint(server): the collective save every rank joins; servers: every
        server's rank (server 0's is where async saves are decided)."""
        self.world, self.comm, self.MPI = world, world.comm, world.MPI
        self.preemption, self.on_checkpoint = preemption, on_checkpoint
        self.sticky_flags = 0  # async/bounded: a preemption, once seen, goes to everyone
        self.index, self.workers = index, workers
        self.servers = servers or [world.rank]
        self.save_ready: set[int] | None = None  # server 0, async: a save asked, who answered
        self.saves_off = False  # async: a worker finished or was dropped (said once)
        self.params = params
        self.opt = FlatOptimizer(cfg.optimizer, params)
        pcfg = cfg.ps
        self.mode, self.bound, self.decay = (
            pcfg["mode"],
            pcfg["staleness_bound"],
            float(pcfg["staleness_decay"]),
        )
        self.timeout = float(pcfg["heartbeat_timeout"])
        self.backoff = P.Backoff(float(pcfg["poll_max_sleep_ms"]) / 1000.0)
        self.lr_of = lr_of  # version -> learning rate
        self.version = 0
        n, nw = params.size, len(workers)
        self.push = [P.Message(n) for _ in workers]
        self.reply = [P.Message(n) for _ in workers]
        self.small = [np.zeros(8, np.int64) for _ in range(2 * nw)]  # pull, ctrl buffers
        self.reply_req = [self.MPI.REQUEST_NULL] * nw
        c = self.comm
        self.reqs = [
            c.Recv_init(m.buf, source=r, tag=P.TAG_PUSH) for m, r in zip(self.push, workers)
        ]
        self.reqs += [
            c.Recv_init(self.small[i], source=r, tag=P.TAG_PULL) for i, r in enumerate(workers)
        ]
        self.reqs += [
            c.Recv_init(self.small[nw + i], source=r, tag=P.TAG_CTRL) for i, r in enumerate(workers)
        ]
        self.decision = np.zeros(8, np.int64)  # another server, async: server 0's GO
        if self.mode != "sync" and index > 0 and on_checkpoint is not None:
            self.reqs.append(c.Recv_init(self.decision, source=self.servers[0], tag=P.TAG_SAVE))
        self.active = set()
        self.done, self.dropped = set(), set()
        self.waiting = []  # sync: workers whose gradient for this version is in
        # heartbeats are judged on the time this process ran, as its watchdog's monitor
        # thread keeps it whatever the server was doing (runtime/clock.py): a whole job
        # suspended and resumed does not drop every worker. A silent worker is judged at
        # two checks, so that a pause that just ended is left out by then.
        self.clock = world.watchdog.clock
        self.last_seen = [self.clock.now()] * nw
        self.suspect: set[int] = set()
        self.stats = {
            "server": index,
            "rank": world.rank,
            "elements": int(n),
            "pushes": 0,
            "pulls": 0,
            "rejected": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "staleness_accepted": {},
            "staleness_rejected": {},
            "scale_sum": 0.0,
            "pushes_per_worker": [0] * nw,
            "dropped": [],
        }

    # --- the loop -------------------------------------------------------------------
    def _post(self, i: int) -> None:
        self.reqs[i].Start()
        self.active.add(i)

    def run(self) -> dict:
        nw = len(self.workers)
        for i in range(len(self.reqs)):
            self._post(i)
        t0, cpu0 = time.monotonic(), time.process_time()
        watch = Stopwatch(self.clock)
        next_check = t0 + min(1.0, self.timeout / 4)
        while len(self.done | self.dropped) < nw:
            for i in P.poll(self.MPI, self.reqs, self.backoff, deadline=next_check):
                self.active.discard(i)
                if i == 3 * nw:  # server 0 says: save (async)
                    self._save_with_server_0()
                    self._post(i)
                    continue
                kind, w = divmod(i, nw)
                self.last_seen[w] = self.clock.now()
                if kind == 0:
                    self._on_push(w)
                elif kind == 1:
                    self._on_pull(w)
                    self._post(i)
                else:
                    self._on_ctrl(w)
                    if w not in self.done:
                        self._post(i)
            now = time.monotonic()
            if now >= next_check:
                self._check_heartbeats(self.clock.now())
                self._decide_save()  # a drop or this rank's own signal calls a save off
                next_check = now + min(1.0, self.timeout / 4)
        self._finish()
        self.stats["seconds"] = watch.elapsed()  # a suspension left out
        self.stats["cpu_seconds"] = time.process_time() - cpu0
        self.stats["version"] = self.version
        return self.stats

    def _finish(self) -> None:
        P.wait_all(self.MPI, self.reply_req, self.backoff, time.monotonic() + self.timeout)
        for i in sorted(self.active):  # receives still posted for dropped/done workers
            self.reqs[i].Cancel()
            self.reqs[i].Wait()
        for r in self.reqs:
            r.Free()

    # --- messages ---------------------------------------------------------------------
    def _own_flags(self) -> int:
        return P.FLAG_PREEMPT if self.preemption is not None and self.preemption.requested else 0

    def _send_reply(self, w: int, status: int, staleness: int = 0, flags: int = 0) -> None:
        P.wait_all(self.MPI, [self.reply_req[w]], self.backoff)
        msg = self.reply[w]
        h = msg.header
        h[P.H_VERSION], h[P.H_STATUS], h[P.H_STALENESS] = self.version, status, staleness
        h[P.H_FLAGS] = flags
        h[P.H_PUSHES], h[P.H_REJECTED] = self.stats["pushes"], self.stats["rejected"]
        msg.lr = self.lr_of(self.version)
        msg.payload[...] = self.params
        self.reply_req[w] = self.comm.Isend(msg.buf, dest=self.workers[w], tag=P.TAG_REPLY)
        self.stats["bytes_out"] += msg.nbytes

    def _on_pull(self, w: int) -> None:
        self.stats["pulls"] += 1
        self._send_reply(w, P.STOPPED if w in self.dropped else P.OK)

    def _on_ctrl(self, w: int) -> None:
        op = int(self.small[len(self.workers) + w][0])
        if op == P.DONE:
            self.done.add(w)
            if self.mode == "sync":
                self._maybe_advance()
            self._decide_save()
        elif op == P.SAVE_READY:
            if self.save_ready is None:  # called off before its answer came: go on
                self._tell(self.workers[w], P.CANCEL)
            else:
                self.save_ready.add(w)
                self._decide_save()

    def _on_push(self, w: int) -> None:
        msg, st = self.push[w], self.stats
        st["bytes_in"] += msg.nbytes
        if w in self.dropped:  # it came back after being dropped: tell it to stop
            self._send_reply(w, P.STOPPED)
            self._post(w)
            return
        st["pushes"] += 1
        st["pushes_per_worker"][w] += 1
        staleness = self.version - int(msg.header[P.H_VERSION])
        if self.mode == "sync":
            if staleness != 0:
                self.world.abort(
                    f"parameter server {self.index}: worker {w} pushed a gradient for version "
                    f"{int(msg.header[P.H_VERSION])} while the server is at {self.version} "
                    "(sync mode protocol violation)"
                )
            self.waiting.append(w)  # its receive is re-posted once the version advances
            self._maybe_advance()
            return
        if self.mode == "bounded" and staleness > self.bound:
            st["rejected"] += 1
            _count(st["staleness_rejected"], staleness)
            self._take_wishes(w, int(msg.header[P.H_FLAGS]))
            self._send_reply(w, P.REJECTED, staleness, self._async_flags())
            self._post(w)
            return
        # async/bounded: a preemption stops every worker at its next exchange (the run
        # then saves at its end); a save is asked of every worker (see the docstring)
        self._take_wishes(w, int(msg.header[P.H_FLAGS]))
        scale = 1.0 / (1.0 + self.decay * staleness) if self.mode == "bounded" else 1.0
        _count(st["staleness_accepted"], staleness)
        st["scale_sum"] += scale
        grad = msg.payload if scale == 1.0 else msg.payload * np.float32(scale)
        self.opt.apply(grad, self.lr_of(self.version))
        self.version += 1
        self._send_reply(w, P.OK, staleness, self._async_flags())
        self._post(w)

    # --- async/bounded checkpoints (see the module docstring) -------------------------
    def _take_wishes(self, w: int, flags: int) -> None:
        self.sticky_flags |= (flags | self._own_flags()) & P.FLAG_PREEMPT
        if self.sticky_flags & P.FLAG_PREEMPT:
            self._decide_save()  # a pending save is called off at once
        if not flags & P.FLAG_SAVE or w != 0 or self.index != 0 or self.save_ready is not None:
            return
        if self.on_checkpoint is None or self.sticky_flags & P.FLAG_PREEMPT:
            return
        gone = sorted(self.done | self.dropped)
        if not gone:
            self.save_ready = set()  # asked in every reply from now on
        elif not self.saves_off:
            self.saves_off = True
            log.info(
                "parameter server: no checkpoint before the end of the run from here: "
                "worker(s) %s finished or were dropped, and a save needs every worker",
                gone,
            )

    def _async_flags(self) -> int:
        return self.sticky_flags | (P.FLAG_SAVE if self.save_ready is not None else 0)

    def _decide_save(self) -> None:
        """Server 0: every worker ready, GO to every worker and server and save; one
        gone or a preemption, CANCEL to those waiting."""
        ready = self.save_ready
        if ready is None:
            return
        if self.done or self.dropped or (self.sticky_flags | self._own_flags()) & P.FLAG_PREEMPT:
            self.save_ready = None
            for w in sorted(ready):
                self._tell(self.workers[w], P.CANCEL)
            return
        if len(ready) < len(self.workers):
            return
        self.save_ready = None
        for rank in [*self.workers, *self.servers[1:]]:
            self._tell(rank, P.GO)
        self._save_with_server_0()

    def _tell(self, rank: int, decision: int) -> None:
        self.comm.Send(P.ctrl(decision, self.index), dest=rank, tag=P.TAG_SAVE)

    def _save_with_server_0(self) -> None:
        """Every worker stopped after a step of its own: the collective save."""
        self.on_checkpoint(self)
        self.last_seen = [self.clock.now()] * len(self.workers)

    def _maybe_advance(self) -> None:
        """Sync: apply the average once every live, unfinished worker has pushed."""
        expected = [w for w in range(len(self.workers)) if w not in self.dropped | self.done]
        if not self.waiting or sorted(self.waiting) != expected:
            return
        order = sorted(self.waiting)
        total = self.push[order[0]].payload.copy()
        for w in order[1:]:
            total += self.push[w].payload
        if len(order) > 1:
            total *= np.float32(1.0 / len(order))
        _count(self.stats["staleness_accepted"], 0, len(order))
        self.stats["scale_sum"] += len(order)
        self.opt.apply(total, self.lr_of(self.version))
        self.version += 1
        self.waiting = []
        flags = self._own_flags()
        for w in order:  # every pusher of this version gets the same flags
            flags |= int(self.push[w].header[P.H_FLAGS])
        for w in order:
            self._send_reply(w, P.OK, flags=flags)
            self._post(w)
        if flags & P.FLAG_SAVE and not flags & P.FLAG_PREEMPT and self.on_checkpoint:
            # the workers join the same collective once they have these replies
            self.on_checkpoint(self)
            self.last_seen = [self.clock.now()] * len(self.workers)

    def _check_heartbeats(self, now: float) -> None:
        for w in range(len(self.workers)):
            if w in self.done or w in self.dropped:
                continue
            silent = now - self.last_seen[w]
            if silent <= self.timeout:
                self.suspect.discard(w)
                continue
            if w not in self.suspect:  # judged again at the next check (see __init__)
                self.suspect.add(w)
                continue
            if self.mode == "sync":
                self.world.abort(
                    f"parameter server {self.index}: worker {w} (rank {self.workers[w]}) sent "
                    f"nothing for {silent:.1f} s (ps.heartbeat_timeout={self.timeout:g}); sync "
                    "mode needs every worker's gradient for each version, so the job ends here "
                    "(use ps.mode=async or bounded to continue without it)"
                )
            self.dropped.add(w)
            self.stats["dropped"].append(w)
            log.warning(
                "parameter server %d: dropped worker %d (rank %d) after %.1f s without a "
                "message; continuing with %d worker(s)",
                self.index,
                w,
                self.workers[w],
                silent,
                len(self.workers) - len(self.dropped | self.done),
            )


def _count(hist: dict, key: int, n: int = 1) -> None:
    hist[int(key)] = hist.get(int(key), 0) + n
