"""No silent hangs: a deadline around every collective that names who never arrived.

Each guarded section tells rank 0 "rank r entered section #k" with one small
non-blocking send on a private communicator. A monitor thread watches the deadline.
When it passes, rank 0 (which holds every arrival notice) names the ranks that never
arrived and aborts the job; another rank waits a short grace period for rank 0 to do
so, and otherwise reports that rank 0 itself did not arrive. On success rank 0 drains
the notices for that section, so the cost is one tiny message per rank per section.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from ..errors import rank_ranges

log = logging.getLogger("hpctrain.watchdog")

_TAG_SPACE = 30000  # arrival tags cycle through [1, _TAG_SPACE]
_GRACE_SECONDS = 3.0
_POLL_SECONDS = 1.0  # how often the monitor looks at the deadlines


class Watchdog:
    """Deadlines for collective sections; see the module docstring for the protocol."""

    def __init__(self, comm, timeout: float, abort):
        self._comm = comm.Dup()  # arrival notices never mix with user traffic
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self._abort = abort  # callable(message) -> never returns
        self._seq = 0
        self._lock = threading.Lock()
        self._active: dict[int, tuple[str, float]] = {}  # seq -> (what, deadline)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._send_buf = np.zeros(1, dtype=np.int64)
        self._pending_sends: list = []

    # --- public ------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str, timeout: float | None = None):
        """Run the body (a collective every rank must enter) under a deadline."""
        if self.size == 1 or self.timeout <= 0:
            yield
            return
        self._seq += 1
        seq = self._seq
        tag = (seq - 1) % _TAG_SPACE + 1
        if self.rank != 0:
            self._send_buf = np.array([seq], dtype=np.int64)
            self._pending_sends.append(self._comm.Isend(self._send_buf, dest=0, tag=tag))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._active[seq] = (what, deadline)
        self._ensure_thread()  # it polls: no wake-up per section (a step holds several)
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(seq, None)
        if self.rank == 0:
            self._drain_arrivals(tag)
        else:
            self._complete_sends()

    def close(self):
        """Stop the monitor thread (the communicator is freed with MPI)."""
        self._thread = None
        self._wake.set()

    # --- internals ---------------------------------------------------------------
    def _drain_arrivals(self, tag: int):
        buf = np.zeros(1, dtype=np.int64)
        for src in range(1, self.size):
            self._comm.Recv(buf, source=src, tag=tag)

    def _complete_sends(self):
        from mpi4py import MPI

        if self._pending_sends:
            MPI.Request.Waitall(self._pending_sends)
            self._pending_sends.clear()

    def _ensure_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._monitor, name="hpctrain-watchdog", daemon=True
            )
            self._thread.start()

    def _monitor(self):
        """Check the oldest deadline every `poll` seconds (at most `_POLL_SECONDS`).

        Polling instead of being woken by each section keeps the guard free of thread
        wake-ups on the training path; a deadline is noticed at most `poll` late.
        """
        me = threading.current_thread()
        poll = min(_POLL_SECONDS, max(0.05, self.timeout / 10))
        while self._thread is me:
            with self._lock:
                soonest = min(self._active.items(), key=lambda kv: kv[1][1], default=None)
            left = poll if soonest is None else soonest[1][1] - time.monotonic()
            if left > 0:
                self._wake.wait(timeout=min(left, poll))
                self._wake.clear()
                continue
            seq, (what, _deadline) = soonest
            with self._lock:
                still_active = seq in self._active
            if still_active:
                self._fire(seq, what)

    def _fire(self, seq: int, what: str):
        tag = (seq - 1) % _TAG_SPACE + 1
        if self.rank == 0:
            from mpi4py import MPI

            arrived = {0}
            status = MPI.Status()
            buf = np.zeros(1, dtype=np.int64)
            while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                self._comm.Recv(buf, source=status.Get_source(), tag=tag)
                arrived.add(status.Get_source())
            missing = sorted(set(range(self.size)) - arrived)
            if missing:
                who = f"rank(s) {rank_ranges(missing)} never arrived"
            else:
                who = "every rank arrived but the operation did not complete"
            self._abort(
                f"watchdog: '{what}' (collective #{seq}) did not finish within "
                f"{self.timeout:g} s: {who}. Raise runtime.collective_timeout if a step "
                f"legitimately takes longer."
            )
        else:
            time.sleep(_GRACE_SECONDS)  # rank 0 normally reports with the full picture
            self._abort(
                f"watchdog: '{what}' (collective #{seq}) did not finish within "
                f"{self.timeout:g} s and rank 0 did not report: rank 0 never arrived."
            )
