"""What a rank tells the watchdog when asked, and the stall report built from the answers.

Each rank keeps its own recent guarded sections locally (no message per section); only
when a deadline or the early warning passes does rank 0 ask every rank for a snapshot
(`Snapshot`), and the answers (or their absence) become the final message and the
report file (`write_report`).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import rank_ranges

RECENT = 8  # sections kept per rank for the report
_STACK_LIMIT = 32_000  # characters of stacks a rank sends (one answer, failure path only)


@dataclass
class Section:
    seq: int
    what: str
    entered: float  # time.time()
    left: float | None = None


@dataclass
class Snapshot:
    """One rank's answer to a probe: where it is and what its threads are doing."""

    rank: int  # world rank
    host: str
    pid: int
    entered: int  # highest section number this rank entered
    recent: list[Section] = field(default_factory=list)
    stacks: str = ""


class SectionLog:
    """The last `RECENT` sections of one communicator, recorded by this rank alone (O(1))."""

    def __init__(self):
        self.entered = 0
        self.recent: deque[Section] = deque(maxlen=RECENT)

    def enter(self, seq: int, what: str) -> Section:
        self.entered = seq
        section = Section(seq, what, time.time())
        self.recent.append(section)
        return section


def python_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints it (works mid-collective)."""
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    return text if len(text) <= _STACK_LIMIT else text[:_STACK_LIMIT] + "\n... (cut)\n"


def snapshot(world_rank: int, log: SectionLog, with_stacks: bool) -> Snapshot:
    return Snapshot(
        world_rank,
        socket.gethostname(),
        os.getpid(),
        log.entered,
        list(log.recent),
        python_stacks() if with_stacks else "",
    )


@dataclass
class Verdict:
    """Who held up section `seq`, from the probe's answers."""

    seq: int
    what: str
    silent: list[int]  # world ranks that did not answer the liveness probe
    absent: dict[int, Snapshot]  # answered, but never entered `seq`

    def summary(self) -> str:
        parts = []
        if self.absent:
            last = "; ".join(
                f"rank {r} never arrived, it last entered {_last(s)}"
                for r, s in sorted(self.absent.items())[:8]
            )
            parts.append(f"rank(s) {rank_ranges(sorted(self.absent))} never arrived ({last})")
        if self.silent:
            parts.append(
                f"rank(s) {rank_ranges(self.silent)} did not answer the liveness probe "
                "(stopped, hung while holding the interpreter, or lost)"
            )
        if not parts:
            parts.append(
                "every rank answered the liveness probe and had entered it, but the "
                "operation did not complete (an MPI or network fault)"
            )
        return "; ".join(parts)


def _last(s: Snapshot) -> str:
    if not s.recent:
        return "nothing yet"
    sec = s.recent[-1]
    state = "still inside" if sec.left is None else "finished"
    return f"'{sec.what}' (#{sec.seq}, {state})"


def judge(seq: int, what: str, members: list[int], answers: dict[int, Snapshot]) -> Verdict:
    silent = [r for r in members if r not in answers]
    absent = {r: s for r, s in answers.items() if s.entered < seq}
    return Verdict(seq, what, silent, absent)


def write_report(
    directory: Path, verdict: Verdict, members: list[int], answers: dict[int, Snapshot]
) -> Path:
    """stall-report-<unix time>.txt in `directory`: per rank, its last sections and stacks."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stall-report-{int(time.time())}-{verdict.seq}.txt"
    lines = [
        f"hpctrain stall report: '{verdict.what}' (collective #{verdict.seq})",
        f"written {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"verdict: {verdict.summary()}",
        "",
    ]
    for r in members:
        s = answers.get(r)
        if s is None:
            lines += [f"=== rank {r}: no answer to the liveness probe ===", ""]
            continue
        lines.append(f"=== rank {r} on {s.host} (pid {s.pid}), entered up to #{s.entered} ===")
        for sec in s.recent:
            took = "still inside" if sec.left is None else f"{sec.left - sec.entered:.3f} s"
            stamp = time.strftime("%H:%M:%S", time.localtime(sec.entered))
            lines.append(f"  #{sec.seq} '{sec.what}' entered {stamp}, {took}")
        lines += ["  Python stacks:", s.stacks.rstrip(), ""]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
