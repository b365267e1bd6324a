"""ZeRO-3's parameter gathers: each unit's full parameters exist only while it runs.

Every rank keeps its shard of each unit (the ZeroPartition layout, stage 3: one segment
per unit). Before a unit's forward or backward its parameters are all-gathered into one
of two buffers (slots) the backend keeps, and the slot is given up right after. The
backend says which unit runs next, so its gather is started ahead (`MPI_Iallgatherv`)
into the other slot and travels while the current unit computes; a progress thread
tests it, because Open MPI moves a non-blocking collective only inside MPI calls (see
overlap.py). At most one prefetch is outstanding: two units live, the running one and
the next.

Order: MPI needs every rank to start the same collectives in the same order. The units
run in the same order on every rank (the same model), and a prefetch is only a gather
started earlier, so the order of gathers is the same everywhere.

Cost per rank and step: forward and backward each gather every unit once (backward
finds the last two units still in their slots), about 2 x (N-1)/N x Psi x 4 bytes, plus
the gradients' reduce-scatter (N-1)/N x Psi x 4: about 1.5x the traffic of ZeRO-1/2 (a ring allreduce's 2x), whatever N (1,024 or 4,096 ranks: the same bytes in
2 x units collectives per step; each collective's latency term grows with log N or N as
Open MPI's algorithm picks).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from .zero import ZeroPartition


class UnitGather:
    """Gather and prefetch ZeRO-3 units into `slots` persistent buffers (framework-free:
    `buffer(u)` is unit u's numpy view of its slot, u % slots).

    A slot is allocated once, at the largest unit's size, and reused: a buffer freed and
    allocated again per gather would come back from the kernel as fresh pages (a unit is
    above glibc's 32 MiB mmap threshold), faulted in and zeroed on every gather. Units u
    and u + slots share a slot; layers run in sequence, so the unit a gather overwrites
    has finished its forward (released) or its backward (its gradients are in). A slot
    keeps its unit's values after release, so a unit still there when needed again (the
    last units, forward then backward) is not gathered again, until `invalidate()` (the
    shard changed: the optimizer stepped or a state was loaded)."""

    def __init__(
        self,
        part: ZeroPartition,
        shard: np.ndarray,
        buffer: Callable[[int], np.ndarray],
        slots: int = 2,
        prefetch: bool = True,
        poll_s: float = 0.0005,
        source: Callable | None = None,
    ):
        """`source(u, piece)`: what unit u's gather sends for this rank's `piece` of the
        shard (a device copy of a host shard's piece); the piece itself by default."""
        self.part, self.shard = part, shard
        self._source = source or (lambda u, piece: piece)
        self._buffer = buffer
        self.slots = slots
        self.prefetch_on = prefetch
        self.poll_s = poll_s
        self.holder: list[int | None] = [None] * slots  # the unit each slot holds
        self.live: set[int] = set()  # in use: not to be overwritten
        self._pending: dict[int, object] = {}  # unit -> PendingArray
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None  # ends when this gather is freed (weakref.finalize)
        self.gathers = 0  # gathers started (for the tests: prefetch on vs off)
        self.waited = 0.0  # seconds spent waiting for gathers

    # --- the units' lifetimes -----------------------------------------------------------
    def need(self, u: int) -> None:
        """Unit u's full parameters, now: waits for its prefetch or gathers it."""
        if self.holder[u % self.slots] != u:
            self._start(u)
        self.live.add(u)
        if u in self._pending:
            t0 = time.perf_counter()
            with self._lock:  # the progress thread stays out while we wait
                self._pending.pop(u).wait()
            self.waited += time.perf_counter() - t0

    def prefetch(self, u: int | None) -> None:
        """Start unit u's gather if it is not in its slot, nothing else is on its way,
        and the slot's unit is not in use."""
        if u is None or not self.prefetch_on or self._pending:
            return
        held = self.holder[u % self.slots]
        if held != u and held not in self.live:
            self._start(u)

    def release(self, u: int) -> None:
        """Unit u is done (its forward, or its backward): its slot may be overwritten."""
        self.live.discard(u)

    def release_all(self) -> None:
        """Every unit released; a prefetch still on its way is waited for (the same
        on every rank)."""
        for u in list(self._pending):
            self.need(u)
        self.live.clear()

    def invalidate(self) -> None:
        """The shard changed: no slot holds current values any more."""
        self.release_all()
        self.holder = [None] * self.slots

    def use_shard(self, shard: np.ndarray) -> None:
        """Gather from `shard` from now on (a new array holding this rank's pieces: a
        backend whose optimizer replaces its shard's buffer on each step)."""
        self.invalidate()
        self.shard = shard

    def is_live(self, u: int) -> bool:
        return u in self.live

    # --- MPI ---------------------------------------------------------------------------
    def _start(self, u: int) -> None:
        part = self.part
        slot = u % self.slots
        held = self.holder[slot]
        if held is not None and held in self._pending:  # never overwrite a gather in flight
            self.need(held)
        self.live.discard(held)  # sequential layers: its forward or backward is over
        seg = part.segments[u]
        buf = self._buffer(u)
        mine = self._source(u, part.shard_view(self.shard, u))
        self.holder[slot] = u
        self.gathers += 1
        if part.n == 1:
            buf[:] = mine
            return
        pending = part.comm.start_allgather_into(
            mine, buf, [seg.piece(part.n)] * part.n, f"ZeRO-3 parameter allgather (unit {u})"
        )
        part._sent += (part.n - 1) * seg.piece(part.n) * 4
        with self._lock:
            self._pending[u] = pending
        self._ensure_thread()
        self._wake.set()

    def _ensure_thread(self) -> None:
        if self._thread is None and self.poll_s > 0:
            self._thread = threading.Thread(
                target=_poll,
                args=(weakref.ref(self), self._wake, self.poll_s),
                name="hpctrain-zero3-prefetch",
                daemon=True,
            )
            weakref.finalize(self, self._wake.set)  # a gather freed ends its thread
            self._thread.start()

    def _busy(self) -> bool:
        """Test the outstanding gathers; False (and the thread sleeps) once none is."""
        with self._lock:
            busy = any(not p.test() for p in self._pending.values())
            if not busy:
                self._wake.clear()
        return busy


def _poll(gather_ref: weakref.ref, wake: threading.Event, poll_s: float) -> None:
    """Test a gather's outstanding allgathers every poll_s while there is one (no
    spinning). The thread holds its gather only while it tests: one it held for good
    would keep the run's shard and slots alive after the run, and itself for the life
    of a process that runs several (a notebook, a sweep)."""
    while True:
        wake.wait()
        gather = gather_ref()
        if gather is None:
            return
        busy = gather._busy()
        del gather
        if busy:
            threading.Event().wait(poll_s)


def memory_figures(
    gather: UnitGather, gathered: int, grad_peak: int, optimizer: float, slots: int
) -> dict[str, float]:
    """A ZeRO-3 rank's figures for metrics.jsonl (both backends): parameters are the
    shard and the `gathered` slot bytes; gradients held at their peak; the optimizer's
    state; the time blocked on gathers; the ZeRO model's figures (`slots` optimizer
    states per parameter)."""
    part = gather.part
    return {
        "mem_param_bytes": float(part.shard_len * 4 + gathered),
        "mem_grad_bytes": float(grad_peak),
        "mem_optimizer_bytes": float(optimizer),
        "zero_gathered_peak_bytes": float(gathered),
        "zero_gather_wait_s": float(gather.waited),
        **part.expected_bytes(slots),
    }
