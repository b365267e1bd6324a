"""Deadlines leave out a pause in which the process did not run (runtime/clock.py): a
job suspended whole (`scontrol suspend`) goes on when resumed. The jobs that show it are
in test_slurm.py (real SLURM) and test_stall.py; here, the rule and the point-to-point
wait with a clock that jumps as a suspension makes it jump."""

import time

import pytest

from hpctrain.runtime import clock, p2p


def test_a_pause_longer_than_the_threshold_beyond_the_sleep_is_not_running():
    assert clock.not_running(100.0, 0.0, 103.0) == 0.0  # a loaded machine's delay: it ran
    assert clock.not_running(100.0, 1.0, 112.0) == 11.0
    assert clock.not_running(100.0, 1.0, 105.5) == 0.0  # 4.5 s beyond its sleep


def test_a_running_clock_leaves_out_only_the_pauses_it_was_told_of():
    c = clock.RunningClock()
    start = c.now()
    now = time.monotonic()
    c.add(clock.not_running(now - 30.0, 0.5, now), now)
    assert c.now() - start == pytest.approx(-29.5, abs=0.5)  # 29.5 s earlier than monotonic


class _Requests:
    """An MPI stand-in whose requests complete at the `done_at`-th test."""

    def __init__(self, done_at: int):
        self.tests, self.done_at = 0, done_at
        self.Request = self

    def Testall(self, requests):
        self.tests += 1
        return self.tests >= self.done_at


class _JumpingTime:
    """time.monotonic as a suspension makes it: +`jump` seconds at the `at`-th reading."""

    def __init__(self, at: int, jump: float):
        self.reads, self.at, self.jump, self.offset = 0, at, jump, 0.0

    def monotonic(self):
        self.reads += 1
        if self.reads == self.at:
            self.offset += self.jump
        return time.perf_counter() + self.offset

    def perf_counter(self):
        return time.perf_counter()

    def sleep(self, seconds):
        time.sleep(seconds)


def test_a_point_to_point_wait_suspended_past_its_deadline_goes_on(monkeypatch):
    fake = _JumpingTime(at=3, jump=60.0)  # 1: the deadline, 2: the wait's start
    monkeypatch.setattr(clock, "time", fake)
    mpi = _Requests(done_at=6)
    deadline = fake.monotonic() + 2.0
    assert p2p.wait_all(mpi, [], p2p.Backoff(0.001), deadline)  # was False at the jump
    assert mpi.tests == 6


def test_a_deadline_shared_by_several_polls_keeps_a_pause_one_of_them_saw(monkeypatch):
    """A compressed ring's hop polls once per piece with one deadline: a pause seen by
    one poll must not expire the next (each computed its own from the same end)."""
    fake = _JumpingTime(at=3, jump=60.0)
    monkeypatch.setattr(clock, "time", fake)
    deadline = clock.Deadline.after(2.0)
    assert not deadline.passed(0.001)  # the first poll sees the pause
    assert not deadline.passed(0.001)  # the next one still waits
    assert deadline.moved == pytest.approx(60.0, abs=0.5)


def test_a_point_to_point_wait_still_ends_at_its_deadline():
    mpi = _Requests(done_at=10**9)
    deadline = time.monotonic() + 0.2
    assert not p2p.wait_all(mpi, [], p2p.Backoff(0.01), deadline)


def test_a_parameter_server_judges_a_silent_worker_at_two_checks():
    """The server's heartbeats use the time its watchdog's monitor thread says the
    process ran. A stop that lands while the server applies an update is left out by
    that thread only once it runs again, which may be after the server's next check:
    so a worker silent at one check is dropped only if silent at the next one too (a
    busy server with a 2048-wide model failed 7 of 10 suspended runs without this)."""
    from hpctrain.strategies.ps.server import Server

    server = Server.__new__(Server)
    server.clock = clock.RunningClock()
    server.done, server.dropped, server.suspect = set(), set(), set()
    server.workers, server.index, server.mode, server.timeout = [0, 1], 0, "async", 3.0
    server.stats = {"dropped": []}
    now = server.clock.now()
    server.last_seen = [now - 8.0, now - 8.0]  # an 8 s pause, not yet left out
    server._check_heartbeats(server.clock.now())
    assert server.dropped == set() and server.suspect == {0, 1}
    server.clock.left_out += 8.0  # the monitor thread has seen the pause
    server.last_seen[1] -= 8.0  # ... but worker 1 really was silent
    server._check_heartbeats(server.clock.now())
    assert server.dropped == {1} and server.suspect == {1}


def test_a_stopwatch_leaves_out_what_its_clock_left_out():
    """A run's elapsed_sec and samples/s count the time it ran: a suspension its
    watchdog's clock left out is reported beside them (suspended_sec), and only the
    part of it after the run started (the clock sees a pause a poll after it ends)."""
    running = clock.RunningClock()
    now = time.monotonic()
    running.add(clock.not_running(now - 40.0, 1.0, now - 30.0), now - 30.0)  # 9 s, before
    watch = clock.Stopwatch(running)
    t0 = time.monotonic()
    running.add(clock.not_running(t0 - 8.0, 1.0, t0 + 0.2), t0 + 0.2)  # 0.2 s of it after
    time.sleep(0.3)
    wall = time.monotonic() - t0
    assert watch.suspended() == pytest.approx(0.2, abs=0.01)
    assert watch.elapsed() == pytest.approx(wall - 0.2, abs=0.02)
    assert clock.Stopwatch().suspended() == 0.0  # no clock: wall time


def test_a_pause_a_deadline_saw_counts_in_the_clock_and_the_stopwatch():
    """The watchdog's probe waits on a Deadline; the pause it saw is added to the clock
    (`add`), so the sections' deadlines and the run's elapsed time both leave it out."""
    running = clock.RunningClock()
    watch = clock.Stopwatch(running)
    time.sleep(0.2)
    before = running.now()
    running.add(0.15, time.monotonic())
    assert running.now() == pytest.approx(before - 0.15, abs=0.01)
    assert watch.suspended() == pytest.approx(0.15, abs=1e-9)


class _OneRank:
    """A communicator of one rank: the watchdog starts no thread."""

    def Dup(self):
        return self

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1


def test_the_watchdog_says_a_pause_whichever_wait_it_fell_in(capsys, monkeypatch):
    """A suspension may fall in the monitor's sleep or in a probe's wait (a liveness check
    running when the job was stopped): either way rank 0 says it once and the run's
    clock leaves it out (test_stall.py's suspended job missed the line 1 run in 30)."""
    from hpctrain.runtime import watchdog

    dog = watchdog.Watchdog(_OneRank(), 3.0, abort=None)
    dog._left_out(0.0, time.monotonic())  # no pause: nothing said, nothing left out
    assert capsys.readouterr().err == "" and dog.clock.pauses == []
    dog._left_out(6.5, time.monotonic())
    assert "watchdog: its thread did not run for 6 s" in capsys.readouterr().err
    assert dog.clock.left_out == 6.5 and len(dog.clock.pauses) == 1

    class _SuspendedWait(clock.Deadline):  # the probe's wait, across a 7 s suspension
        @classmethod
        def after(cls, seconds):
            waited = cls(time.monotonic() + seconds)
            waited.moved = 7.0
            return waited

    class _MPI:
        COMM_WORLD = _OneRank()
        Status = staticmethod(lambda: None)

    monkeypatch.setattr(watchdog, "Deadline", _SuspendedWait)
    dog._MPI = _MPI
    assert set(dog._probe(with_stacks=False)) == {0}  # its own answer
    assert "watchdog: its thread did not run for 7 s" in capsys.readouterr().err
    assert dog.clock.left_out == 13.5 and len(dog.clock.pauses) == 2
