"""No silent hangs: a deadline around every collective that names the rank holding it up.

Happy path: nothing is sent. Each rank records its own guarded sections (number, name,
times) in a local ring of the last few; a monitor thread per communicator checks the
deadlines every poll (at most 1 s) and answers liveness probes.

When a section has waited `stall_warning` seconds (an early warning) or the collective
timeout (the deadline), the rank that noticed tells rank 0 (one message), and rank 0's
monitor probes every rank. Each live rank's monitor answers with its section log (and,
at the deadline, its Python stacks); a rank that is stopped (SIGSTOP), hung while
holding the interpreter or lost cannot answer. Rank 0 then names:
- ranks that answered but never entered the section, with what they last entered;
- ranks that did not answer within the probe's wait, even if they had entered it.
At the warning it prints this once; at the deadline it writes a report (every rank's
last sections and stacks) into the directory the loop set (`set_report_dir`) and ends
the job. If rank 0 itself does not answer, the other ranks end the job naming rank 0.

A wait with a longer deadline of its own (a checkpoint write's, the parameter server's
end, which has none) is checked at every collective timeout instead: rank 0 probes, and
only a rank silent to two probes ends it (`_check_alive`); ranks still at work answer.
So is every wait before a run's first step (`starting`), under `startup_timeout`. Each
deadline counts only the time this process ran: a job suspended whole and resumed goes
on (clock.py).

Cost per guarded collective: a counter, a lock and a ring append on the calling rank,
no message and no thread wake-up, so it does not grow with the number of ranks
(benchmarks/bench_watchdog.py, 2-core VM: 5.5-7.4 us of CPU per guard at np 2, 4, 8
and 16 alike, 0 messages; projected to 1,024 and 4,096 ranks: the same ~7 us and 0
messages per collective, where the old arrival notices cost rank 0 N-1 = 1,023 and
4,095 receives per collective, ~44 ms and ~180 ms at the slope measured up to np 16,
oversubscribed). Background: each monitor does one MPI_Iprobe per poll (<= 1 s), per rank.
Failure path only: the probe is N-1 small sends and answers on rank 0 (at 4,096 ranks,
about 4,095 answers of up to 32 kB of stacks: ~130 MB and a few seconds, once).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from pathlib import Path

from . import stall
from .clock import Deadline, RunningClock, not_running

_TAG_NOTICE, _TAG_PROBE, _TAG_ANSWER, _TAG_ALIVE_OK = 1, 2, 3, 4
_PROBE_WAIT = 5.0  # how long rank 0 waits for answers: live monitors answer within a poll
_GRACE_SECONDS = 3.0  # beyond the probe, how long other ranks wait for rank 0 to report
_POLL_SECONDS = 1.0  # how often the monitor looks at deadlines and probes


class Watchdog:
    """Deadlines for collective sections; see the module docstring for the protocol."""

    def __init__(self, comm, timeout: float, abort, stall_warning: float = 60.0):
        self._comm = comm.Dup()  # probes and answers never mix with user traffic
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.stall_warning = float(stall_warning)
        # from a run's start (World.begin_startup) to its first step (end_startup) waits
        # may take startup_timeout
        self.starting, self.startup_timeout = False, float(timeout)
        self.report_dir: Path | None = None
        self._abort = abort  # callable(message) -> never returns
        self._seq = 0
        self._lock = threading.Lock()
        self._log = stall.SectionLog()
        # time.monotonic less the pauses in which this process did not run, as the monitor
        # thread sees them whatever the main thread does (clock.py; the parameter
        # server's heartbeats read it too)
        self.clock = RunningClock()
        self.says_pauses = True  # the world's says it; its axes' would say it again
        self._active: dict[int, tuple[str, float, float]] = {}  # seq -> (what, entered, limit)
        self._noticed: set[tuple[int, str]] = set()  # (seq, "warn"|"deadline") handled
        self._give_up_at: tuple[float, int, str, float] | None = None
        # long waits past the collective timeout: when rank 0 last started a check that
        # every rank answered, and elsewhere the checks asked of rank 0:
        # (seq, "alive-<round>") -> (give up at, what, limit)
        self._alive_at: float | None = None
        self._awaiting_ok: dict[tuple[int, str], tuple[float, str, float]] = {}
        self._round = 0
        self._sends: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.size > 1:
            self._thread = threading.Thread(
                target=self._monitor, name="hpctrain-watchdog", daemon=True
            )
            self._thread.start()
            atexit.register(self.close)  # runs before mpi4py's MPI_Finalize (LIFO)

    # --- public ------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str, timeout: float | None = None):
        """Run the body (a collective every rank must enter) under a deadline."""
        if self.size == 1 or self.timeout <= 0:
            yield
            return
        self._seq += 1
        seq = self._seq
        limit = timeout
        if timeout is None:
            limit, option = self.default_limit()
            if option != "runtime.collective_timeout":  # a deadline of its own, named in
                what = f"{what} (start-up, {option})"  # `what`, with liveness checks
        with self._lock:
            section = self._log.enter(seq, what)
            self._active[seq] = (what, self.clock.now(), limit)
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(seq, None)
                section.left = time.time()

    def default_limit(self) -> tuple[float, str]:
        """The deadline of a wait that has none of its own, and the option setting it.
        While a run starts (ranks import, build and read at their own pace: a parameter
        server's servers waited for workers importing torch) the start-up's, if longer."""
        if self.starting and self.startup_timeout > self.timeout:
            return self.startup_timeout, "runtime.startup_timeout"
        return self.timeout, "runtime.collective_timeout"

    def close(self):
        """Stop the monitor thread before MPI is finalised."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # --- the monitor thread ----------------------------------------------------------
    def _monitor(self):
        from mpi4py import MPI

        self._MPI = MPI
        now = self.clock.now()
        while not self._stop.is_set():
            if MPI.Is_finalized():
                return
            self._serve()
            self._check_deadlines(now)  # read after the wait: a pause after it comes next
            poll = min(_POLL_SECONDS, max(0.05, self.timeout / 10)) if self.timeout > 0 else 1
            before = time.monotonic()
            self._stop.wait(poll)
            after = time.monotonic()
            self._left_out(not_running(before, poll, after), after)
            now = after - self.clock.left_out

    def _left_out(self, pause: float, end: float) -> None:
        """Leave out of the deadlines and the run's elapsed time a pause this thread saw
        (in its wait, or in a probe's: whichever the suspension fell in), and say so."""
        if not pause:
            return
        self.clock.add(pause, end)
        if self.rank == 0 and self.says_pauses:
            sys.stderr.write(
                f"[rank 0] watchdog: its thread did not run for {pause:.0f} s (the "
                "process suspended, or the interpreter held); deadlines leave that out\n"
            )
            sys.stderr.flush()

    def _check_deadlines(self, now: float):
        with self._lock:
            active = list(self._active.items())
        for seq, (what, entered, limit) in active:
            if now < entered:  # entered after a resume, before its pause was left out
                with self._lock:
                    if seq in self._active:
                        self._active[seq] = (what, now, limit)
                continue
            # a wait with a deadline of its own (a checkpoint write's) warns at half of
            # it: a 100 GB write warned at every save that its writer "never arrived"
            warn = self.stall_warning if limit == self.timeout else limit / 2
            waited = now - entered
            if waited >= limit:
                self._stalled(seq, what, "deadline", limit)
                continue
            if limit > self.timeout and waited >= self.timeout:  # a longer deadline's liveness
                rounds = int(waited // self.timeout)  # check, again every collective timeout
                self._stalled(seq, what, f"alive-{rounds}", limit)
            if self.stall_warning > 0 and warn < limit and waited >= warn:
                self._stalled(seq, what, "warn", limit)
        self._check_rank0_answered(now, {seq for seq, _ in active})
        if self._give_up_at and now >= self._give_up_at[0]:
            _, seq, what, limit = self._give_up_at
            self._abort(
                f"watchdog: '{what}' (collective #{seq}) did not finish within "
                f"{limit:g} s and rank 0 did not report: rank 0 never arrived or "
                "does not answer (stopped or hung)."
            )

    def _stalled(self, seq: int, what: str, kind: str, limit: float):
        if (seq, kind) in self._noticed:
            return
        self._noticed.add((seq, kind))
        if self.rank == 0:
            if kind.startswith("alive"):
                self._answer_alive(seq, kind, what, limit, None)
            else:
                self._investigate(seq, what, kind, limit)
            return
        self._sends.append(self._comm.isend((seq, what, kind, limit), dest=0, tag=_TAG_NOTICE))
        if kind.startswith("alive"):  # rank 0 answers once it has checked (two probes at most)
            until = self.clock.now() + 2 * _PROBE_WAIT + _GRACE_SECONDS
            self._awaiting_ok[(seq, kind)] = (until, what, limit)
        if kind == "deadline":
            give_up = self.clock.now() + _PROBE_WAIT + _GRACE_SECONDS
            self._give_up_at = (give_up, seq, what, limit)

    def _serve(self):
        """Answer probes (every rank) and act on other ranks' notices (rank 0)."""
        MPI, status = self._MPI, self._MPI.Status()
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            src, tag = status.Get_source(), status.Get_tag()
            msg = self._comm.recv(source=src, tag=tag)
            if tag == _TAG_PROBE:
                round_id, with_stacks = msg
                self._sends.append(
                    self._comm.isend((round_id, self._snapshot(with_stacks)), 0, _TAG_ANSWER)
                )
            elif tag == _TAG_NOTICE and self.rank == 0:
                seq, what, kind, limit = msg
                if kind.startswith("alive"):  # each rank's question gets its answer
                    self._answer_alive(seq, kind, what, limit, src)
                elif (seq, kind) not in self._noticed:
                    self._noticed.add((seq, kind))
                    self._investigate(seq, what, kind, limit)
            elif tag == _TAG_ALIVE_OK:
                self._awaiting_ok.pop(tuple(msg), None)
            # a late answer from an earlier round is dropped
        self._sends = [r for r in self._sends if not r.Test()]

    def _snapshot(self, with_stacks: bool) -> stall.Snapshot:
        with self._lock:
            return stall.snapshot(self._MPI.COMM_WORLD.Get_rank(), self._log, with_stacks)

    # --- rank 0: probe, judge, warn or end the job --------------------------------------
    def _investigate(self, seq: int, what: str, kind: str, limit: float):
        deadline = kind == "deadline"
        with_stacks = deadline and self.report_dir is not None
        answers = self._probe(with_stacks)
        members = self._world_ranks()
        verdict = stall.judge(seq, what, members, answers)
        if not deadline:
            waited = (
                f"{self.stall_warning:g} s (runtime.stall_warning)"
                if limit == self.timeout
                else f"{limit / 2:g} s, half its deadline"
            )
            sys.stderr.write(
                f"[rank 0] WARNING: watchdog: '{what}' (collective #{seq}) has waited "
                f"{waited}: {verdict.summary()}\n"
            )
            sys.stderr.flush()
            return
        where = ""
        if self.report_dir is not None:
            try:
                where = (
                    f" Report: {stall.write_report(self.report_dir, verdict, members, answers)}."
                )
            except OSError as exc:
                where = f" (the stall report could not be written in {self.report_dir}: {exc})"
        # a section with a deadline of its own names the option that sets it in `what`
        advice = (
            " Raise runtime.collective_timeout if a step legitimately takes longer."
            if limit == self.timeout
            else ""
        )
        self._abort(
            f"watchdog: '{what}' (collective #{seq}) did not finish within "
            f"{limit:g} s: {verdict.summary()}.{where}{advice}"
        )

    def _answer_alive(self, seq: int, kind: str, what: str, limit: float, src: int | None):
        """Rank 0: a long wait's liveness check, asked by `src` (None: rank 0's own). One
        check serves every question of the next half collective timeout: the ranks of one
        long wait ask at about the same time, and their sections' numbers differ (each
        rank counts its own), so they cannot tell rank 0 they are asking about one wait."""
        now = self.clock.now()
        if self._alive_at is None or now - self._alive_at >= self.timeout / 2:
            self._check_alive(seq, kind, what, limit)  # ends the job when a rank is silent
            self._alive_at = now
        if src is not None:
            self._sends.append(self._comm.isend((seq, kind), src, _TAG_ALIVE_OK))

    def _check_alive(self, seq: int, kind: str, what: str, limit: float):
        """A wait with a long deadline of its own (a checkpoint write's, 1 h by default)
        that has passed the collective timeout: the ranks still writing answer the probe
        and it waits on; a rank silent to two probes in a row (stopped or lost, not busy:
        a writing rank's monitor answers within a poll) cannot finish it, and the job
        ends now rather than at the long deadline. A rank whose question rank 0 does not
        answer names rank 0. Cost: nothing unless a wait is that long; then, once per
        collective timeout (600 s by default), N-1 questions and answers of a few bytes
        and one probe of N-1 snapshots without stacks (about 1 kB each): at 1,024 ranks
        ~3,000 messages and ~1 MB on rank 0, at 4,096 ~12,000 and ~4 MB, every 10
        minutes of a long write; a second probe only when a rank is silent."""
        members = self._world_ranks()
        first = stall.judge(seq, what, members, self._probe(False))
        if not first.silent:
            return
        answers = self._probe(self.report_dir is not None)
        silent = [r for r in members if r not in answers and r in first.silent]
        if not silent:
            return
        verdict = stall.Verdict(seq, what, silent, {})  # the others write on: not the cause
        where = ""
        if self.report_dir is not None:
            with contextlib.suppress(OSError):
                where = (
                    f" Report: {stall.write_report(self.report_dir, verdict, members, answers)}."
                )
        self._abort(
            f"watchdog: '{what}' (collective #{seq}) {self._waited(kind, limit)}: "
            f"{verdict.summary()}, twice {_PROBE_WAIT:g} s apart, so it cannot finish.{where}"
        )

    def _waited(self, kind: str, limit: float) -> str:
        """How long a long wait had waited at its liveness check `kind` ("alive-<round>")."""
        waited = int(kind.rsplit("-", 1)[1]) * self.timeout
        of = f" of its {limit:g} s" if limit != float("inf") else ", with no deadline of its own"
        return f"has waited {waited:g} s{of} (checked every runtime.collective_timeout)"

    def _check_rank0_answered(self, now: float, active: set[int]) -> None:
        """A rank other than 0 whose long wait asked rank 0 to check on every rank: no
        answer in time means rank 0 itself is stopped or lost (it holds the check)."""
        for key, (until, what, limit) in list(self._awaiting_ok.items()):
            seq, kind = key
            if seq not in active:  # the wait ended: nothing to answer for
                del self._awaiting_ok[key]
            elif now >= until:
                self._abort(
                    f"watchdog: '{what}' (collective #{seq}) {self._waited(kind, limit)}, "
                    f"and rank 0 did not answer within {2 * _PROBE_WAIT + _GRACE_SECONDS:g} s "
                    "when asked to check on every rank: rank 0 is stopped, hung while holding "
                    "the interpreter, or lost, so it cannot finish."
                )

    def _probe(self, with_stacks: bool) -> dict[int, stall.Snapshot]:
        """Ask every rank's monitor for its snapshot; keyed by world rank; waits at most
        `_PROBE_WAIT` seconds (a stopped rank never answers)."""
        MPI = self._MPI
        self._round += 1
        round_id = self._round
        for r in range(1, self.size):
            self._sends.append(self._comm.isend((round_id, with_stacks), r, _TAG_PROBE))
        mine = self._snapshot(with_stacks)
        answers = {mine.rank: mine}
        status = MPI.Status()
        until = Deadline.after(_PROBE_WAIT)  # a suspension meanwhile is no one's silence
        while len(answers) < self.size and not until.passed(0.01):
            if self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_ANSWER, status=status):
                got_round, snap = self._comm.recv(source=status.Get_source(), tag=_TAG_ANSWER)
                if got_round == round_id:
                    answers[snap.rank] = snap
            else:
                time.sleep(0.01)
        self._left_out(until.moved, time.monotonic())  # out of the sections' deadlines too
        return answers

    def _world_ranks(self) -> list[int]:
        MPI = self._MPI
        return list(
            MPI.Group.Translate_ranks(
                self._comm.Get_group(), list(range(self.size)), MPI.COMM_WORLD.Get_group()
            )
        )
