"""Deadlines that leave out the time a process was not running.

A job suspended whole (`scontrol suspend`, SLURM's suspend preemption, a SIGSTOP to
every rank) and resumed later must go on where it was: its collectives did not take
longer, its processes were not running. Time.monotonic keeps counting through a
suspension, so each loop that watches a deadline (the watchdog's monitor, the
point-to-point waits, the parameter server's heartbeats) notices a pause of its own
longer than `NOT_RUNNING_SECONDS` beyond what it slept, and leaves that pause out. A
rank stopped alone is still named: the others, running, count on.
"""

from __future__ import annotations

import time

# No poll of ours sleeps for more than a second: a pause this much longer than the sleep
# asked for is a process that was not running (stopped, or the machine suspended it),
# not a slow one (a loaded machine delays a thread by milliseconds to a second or two).
NOT_RUNNING_SECONDS = 5.0


def not_running(since: float, expected: float, now: float) -> float:
    """Seconds a loop was not running from `since` to `now` (time.monotonic) beyond the
    `expected` seconds it slept or worked: 0 unless more than NOT_RUNNING_SECONDS. A
    loop that compares `now` with a deadline passes the same `now`, so a pause cannot
    fall between the two readings."""
    pause = now - since - expected
    return pause if pause > NOT_RUNNING_SECONDS else 0.0


class RunningClock:
    """time.monotonic less the pauses its loop reported (`add`): deadlines read from it
    count only the time this process ran."""

    def __init__(self) -> None:
        self.left_out = 0.0
        self.pauses: list[tuple[float, float]] = []  # (time.monotonic at its end, seconds)

    def now(self) -> float:
        return time.monotonic() - self.left_out

    def add(self, pause: float, end: float) -> None:
        """Leave out `pause` seconds (`not_running`, or a deadline's `Deadline.moved`)
        that ended at `end` (time.monotonic)."""
        self.left_out += pause
        self.pauses.append((end, pause))


class Deadline:
    """A deadline in time.monotonic that moves on by each pause in which this process
    did not run, as seen between one reading (`passed`) and the next. Several waits may
    share one (a ring's hop polls once per piece): a pause seen by one is kept."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.moved = 0.0  # the pauses left out so far
        self._last = time.monotonic()

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def passed(self, expected: float = 0.0) -> bool:
        """Whether it has passed; `expected`: the longest the caller sleeps or works
        between two readings (more than that, and NOT_RUNNING_SECONDS, is a pause)."""
        now = time.monotonic()
        pause = not_running(self._last, expected, now)
        self.at += pause
        self.moved += pause
        self._last = now
        return now >= self.at


class Stopwatch:
    """Seconds a run worked since it started: wall time less the pauses its process's
    `clock` left out (a job suspended whole and resumed reports elapsed_sec and
    samples/s over the time it ran, and the time suspended beside them). Only the part
    of a pause after the start counts, though the clock may see it a poll later."""

    def __init__(self, clock: RunningClock | None = None) -> None:
        self._clock = clock
        self._start = time.monotonic()

    def suspended(self) -> float:
        """Seconds left out since the start."""
        if self._clock is None:
            return 0.0
        start = self._start
        return sum(max(0.0, end - max(start, end - pause)) for end, pause in self._clock.pauses)

    def elapsed(self) -> float:
        """Seconds since the start, less those left out."""
        return time.monotonic() - self._start - self.suspended()
