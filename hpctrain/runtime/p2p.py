"""Point-to-point waits with a deadline that name the peer that never answered.

Collectives are guarded by the watchdog (every rank of a communicator enters the same
section). Point-to-point traffic (pipeline activations, parameter-server pushes) has a
known peer instead, so its waits poll the requests with a sleeping backoff (no busy
core) until a deadline, and on expiry end the job naming the peer and what it owed.
Cost: one Testall per poll, independent of the number of ranks.
"""

from __future__ import annotations

import math
import time

from .clock import Deadline


class Backoff:
    """Poll without sleeping for `spin_s` after the last event (a reply usually follows
    within microseconds), then sleep a little longer each idle poll, up to `max_sleep_s`.

    max_sleep_s=0 polls without ever sleeping (lowest latency, one busy core per rank).
    """

    def __init__(self, max_sleep_s: float, spin_s: float = 200e-6, first_s: float = 50e-6):
        self.max, self.spin, self.first = max_sleep_s, spin_s, first_s
        self.cur = 0.0
        self.since = None

    def idle(self) -> None:
        if self.max <= 0:
            return
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        if now - self.since < self.spin:
            return
        time.sleep(self.cur)
        self.cur = min(self.max, self.first if self.cur == 0 else self.cur * 2)

    def reset(self) -> None:
        self.cur = 0.0
        self.since = None


def poll(MPI, requests: list, backoff: Backoff, deadline=None) -> list[int]:
    """Indices of requests that completed, waiting (with backoff) until at least one has.

    Returns [] when `deadline` (time.monotonic, or a clock.Deadline that several polls
    share) passes first, or when none is active. A pause while this process was not
    running (suspended) does not count (clock.py).
    """
    until = _deadline(deadline)
    while True:
        done = MPI.Request.Testsome(requests)
        if done is None:
            return []
        if done:
            backoff.reset()
            return list(done)
        if until is not None and until.passed(backoff.max):
            return []
        backoff.idle()


def wait_all(MPI, requests: list, backoff: Backoff, deadline=None) -> bool:
    """Wait for every request with backoff; False if the deadline (as for `poll`) passed
    first, not counting a pause while this process was not running (clock.py)."""
    until = _deadline(deadline)
    while not MPI.Request.Testall(requests):
        if until is not None and until.passed(backoff.max):
            return False
        backoff.idle()
    backoff.reset()
    return True


def _deadline(deadline) -> Deadline | None:
    return deadline if deadline is None or isinstance(deadline, Deadline) else Deadline(deadline)


def wait_or_abort(
    world,
    requests: list,
    what: str,
    peers,
    backoff: Backoff | None = None,
) -> None:
    """Wait for `requests`; past the collective timeout (the start-up's while a run
    starts: `Watchdog.default_limit`) end the job with a message naming `what` and the
    peer(s) still owing a message. `world` is any guarded communicator (the World or a
    grid axis).

    `peers` is one description per request (e.g. "stage 1 (rank 3)") or a single string.
    """
    limit, option = world.watchdog.default_limit()
    deadline = Deadline.after(limit) if limit and limit > 0 else None
    if wait_all(world.MPI, requests, backoff or Backoff(0.5e-3), deadline):
        return
    if isinstance(peers, str):
        late = [peers]
    else:
        late = [p for p, r in zip(peers, requests) if not r.Test()]
    world.abort(
        f"{what}: no answer from {', '.join(late) or 'a peer'} within {limit:g} s "
        f"({option}): that rank stopped, hangs, or lost its link"
    )


def wait_while_every_rank_answers(world, requests: list, what: str, backoff: Backoff) -> None:
    """Wait for `requests` with no deadline of their own, for as long as every rank of
    `world` answers the watchdog's liveness probe (asked every collective timeout: a
    stopped or lost rank is named then). For a wait whose length is the others' work,
    not a fault: finished ranks waiting for slower ones."""
    with world.watchdog.guard(what, timeout=math.inf):
        wait_all(world.MPI, requests, backoff)
