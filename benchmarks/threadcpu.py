"""CPU time of each rank's threads besides its compute thread, sampled from /proc.

Why: when every core computes, whatever else a rank runs (Horovod's background thread,
which negotiates with the other ranks every cycle even when idle, the watchdog, MPI
progress) takes the core from compute. `/proc/<pid>/task/<tid>/schedstat` holds each
thread's CPU time in nanoseconds; sampling it while a job runs shows that share.
"""

from __future__ import annotations

import os
import threading
import time


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent
            out.append(int(entry))
    return out


def _thread_ns(pid: int) -> dict[int, int]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


class ThreadSampler:
    """Samples the threads of `root`'s child processes (mpirun's ranks) until stopped."""

    def __init__(self, root: int, interval: float = 0.2):
        self.root = root
        self.interval = interval
        self.samples: dict[int, list[tuple[float, dict[int, int]]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ThreadSampler:
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for pid in _children(self.root):
                threads = _thread_ns(pid)
                if threads:
                    self.samples.setdefault(pid, []).append((now, threads))

    def stop(self) -> dict | None:
        """Per rank: the compute (busiest) thread's and all other threads' share of a core.

        The window is the longest run of samples holding the rank's most threads: the
        training phase, after start-up and before shutdown.
        """
        self._stop.set()
        self._thread.join()
        ranks = [share for s in self.samples.values() if (share := _shares(s))]
        if not ranks:
            return None
        return {
            "ranks": ranks,
            "other_threads": sum(r["other_threads"] for r in ranks) / len(ranks),
            "compute_thread": sum(r["compute_thread"] for r in ranks) / len(ranks),
        }


def _shares(samples) -> dict | None:
    most = max(len(s[1]) for s in samples)
    best, run = [], []
    for sample in samples:
        run = run + [sample] if len(sample[1]) == most else []
        if len(run) > len(best):
            best = run
    if len(best) < 2:
        return None
    (t0, first), (t1, last) = best[0], best[-1]
    deltas = sorted((last[tid] - first.get(tid, 0) for tid in last), reverse=True)
    seconds = t1 - t0
    return {
        "seconds": seconds,
        "threads": most,
        "compute_thread": deltas[0] / 1e9 / seconds,
        "other_threads": sum(deltas[1:]) / 1e9 / seconds,
    }


class NamespaceCpu:
    """CPU seconds of the processes inside the emulated cluster's nodes during a job.

    Why: mpirun exits without reaping the rsh agents that started its daemons on the
    nodes, so getrusage(RUSAGE_CHILDREN) never sees the ranks there (measured: 0.04 s
    for two ranks busy 3 s each), and their work showed as "other load". Each process
    whose network namespace is a node's (/run/netns/hpcnK) is sampled every `interval`;
    its last utime + stime counts. A process's last interval before it exits is missed.
    """

    def __init__(self, netns_dir: str = "/run/netns", prefix: str = "hpcn", interval=0.25):
        self.interval = interval
        try:
            names = [n for n in os.listdir(netns_dir) if n.startswith(prefix)]
            self.inodes = {os.stat(os.path.join(netns_dir, n)).st_ino for n in names}
        except OSError:
            self.inodes = set()
        self.last: dict[tuple[int, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> NamespaceCpu:
        if self.inodes:
            self._thread.start()
        return self

    def _sample(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino not in self.inodes:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields 14, 15 of stat (utime, stime); 22 (start time) tells a reused pid
            self.last[(int(entry), fields[19])] = int(fields[11]) + int(fields[12])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> float:
        if not self.inodes:
            return 0.0
        self._stop.set()
        self._thread.join()
        return sum(self.last.values()) / os.sysconf("SC_CLK_TCK")
