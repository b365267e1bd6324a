"""Where numbers go: <run-dir>/metrics.jsonl, TensorBoard scalars, and rank-0 progress.

Only rank 0 writes; every record is already reduced over ranks by the caller. Every JSONL
line carries the same core keys (event, epoch, step, loss, val_loss, val_accuracy,
samples_per_sec; null where not measured) so tools can read any line the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
import types
from pathlib import Path

from .errors import HpctrainError
from .runtime import diskspace

CORE_KEYS = ("event", "epoch", "step", "loss", "val_loss", "val_accuracy", "samples_per_sec")


class _LineLog:
    """An append-only text file that holds whole lines only.

    A line that does not fit (a full disk) is cut back off, and a partial last line
    left by a crash is dropped when the file is opened again, so every line a reader
    finds is a complete record.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._drop_partial_line()

    def _drop_partial_line(self) -> None:
        size = os.fstat(self._fd).st_size
        end = size
        while end > 0:
            start = max(0, end - 4096)
            chunk = os.pread(self._fd, end - start, start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        if end != size:
            os.ftruncate(self._fd, end)

    def append(self, line: str) -> None:
        data = memoryview(line.encode())
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            os.ftruncate(self._fd, start)  # shrinking needs no space
            raise

    def close(self) -> None:
        os.close(self._fd)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def tensorboard_problem(wanted: bool) -> str | None:
    """Why metrics.tensorboard cannot be written by this Python: the package is missing
    (the run failed with a ModuleNotFoundError traceback once it had started)."""
    if not wanted or importlib.util.find_spec("tensorboard") is not None:
        return None
    return (
        "metrics.tensorboard=true (the default) needs the tensorboard package, which "
        f"{sys.executable} lacks: pip install tensorboard, or set metrics.tensorboard=false"
    )


class MetricsWriter:
    """JSONL + TensorBoard on rank 0; a no-op elsewhere."""

    def __init__(
        self, run_dir: Path | None, enabled: bool, jsonl: bool = True, tensorboard: bool = True
    ):
        self.enabled = enabled and run_dir is not None
        self._jsonl = None
        self._tb = None
        self._tb_before = False
        self._failed = False
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run_dir = run_dir
        if jsonl:
            self._jsonl = _LineLog(run_dir / "metrics.jsonl")
        if tensorboard:
            # tensorboard imports TensorFlow when it is installed unless the module
            # tensorboard.compat.notf exists; its stub writes the same event files, and a
            # torch run should not pay 2 s and 500 MB for a TensorFlow it never uses.
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            tb = run_dir / "tb"  # an earlier attempt's events there: see start()
            self._tb_before = tb.is_dir() and any(tb.glob("events.out.tfevents.*"))
            self._tb = EventFileWriter(str(tb))

    def write(self, event: str, **fields) -> dict:
        record = {k: None for k in CORE_KEYS}
        record.update(event=event, time=round(time.time(), 3))
        record.update({k: _clean(v) for k, v in fields.items()})
        if not self.enabled:
            return record
        if self._jsonl is not None:
            with self._disk_errors(self._jsonl.path):
                self._jsonl.append(json.dumps(record, sort_keys=False) + "\n")
        if self._tb is not None and record.get("step") is not None:
            with self._disk_errors(self._run_dir / "tb"):
                self._scalars(event, record)
        return record

    def start(self, step: int, epoch: int, resumed_from: str | None) -> None:
        """A `start` line, and where tb/ holds an earlier attempt's events TensorBoard's
        restart marker: a SessionLog START at step + 1 makes its EventAccumulator drop
        what they logged after this run's starting point (an abandoned timeline: a crash
        after the checkpoint, --resume FILE of an older one, or a requeue before the
        first save; TensorBoard 2.21's server ignores it, docs/training.md says what it
        shows); metrics.jsonl keeps those lines, before this one."""
        self.write("start", epoch=epoch, step=step, resumed_from=resumed_from)
        if self._tb is None or not (resumed_from or self._tb_before):
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        with self._disk_errors(self._run_dir / "tb"):
            marker = SessionLog(status=SessionLog.START)
            self._tb.add_event(Event(wall_time=time.time(), step=step + 1, session_log=marker))

    @contextlib.contextmanager
    def _disk_errors(self, path: Path):
        """A full disk (or another write error) stops the run with one line naming the
        file and the free space; rank 0 alone writes, so fail-together ends every rank."""
        try:
            yield
        except OSError as exc:
            self.enabled, self._failed = False, True  # nothing more is written
            why = diskspace.no_space(path) if diskspace.is_full(exc) else str(exc)
            raise HpctrainError(f"metrics: cannot write {path}: {why}") from exc

    def _scalars(self, event: str, record: dict):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=f"{event}/{k}", simple_value=float(v))
            for k, v in record.items()
            if k not in ("event", "epoch", "step", "time")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        ]
        if values:
            self._tb.add_event(
                Event(
                    wall_time=record["time"],
                    step=int(record["step"]),
                    summary=Summary(value=values),
                )
            )

    def close(self):
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            tb, self._tb = self._tb, None
            if self._failed:  # already reported: closing must not raise a second error
                with contextlib.suppress(Exception):
                    tb.close()
                return
            with self._disk_errors(self._run_dir / "tb"):
                tb.close()


LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "horovodrun")
ANCESTORS_CHECKED = 4  # rank -> (orted/prted) -> mpirun -> shell


def _fd2_is_terminal(pid: int) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty", "/dev/console"))


def _parent_and_name(pid: int) -> tuple[int, str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0, ""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2 :].split()[1]), name


def stderr_is_terminal(env=None) -> bool:
    """True when this rank's stderr ends on a terminal, under mpirun too.

    mpirun hands its ranks pipes, not its terminal, so `isatty()` is false on every
    rank even when the user watches mpirun in a terminal. Then the launcher's own
    stderr decides: the nearest mpirun/mpiexec among this process's few ancestors
    (Linux /proc; on rank 0, which mpirun starts on its own node). A job whose output
    goes to a file (sbatch, `> log`) gets no bar. HPCTRAIN_PROGRESS=1/0 forces it.
    """
    env = os.environ if env is None else env
    forced = env.get("HPCTRAIN_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    if sys.stderr.isatty():
        return True
    pid = os.getppid()
    for _ in range(ANCESTORS_CHECKED):
        parent, name = _parent_and_name(pid)
        if name in LAUNCHERS:
            return _fd2_is_terminal(pid)
        if parent <= 1:
            break
        pid = parent
    return False


class Progress:
    """A tqdm bar on rank 0 when its output reaches a terminal; periodic log lines otherwise."""

    def __init__(self, enabled: bool, total: int, log, log_every: int, bar: bool = True):
        self.enabled = enabled
        self.log = log
        self.log_every = log_every
        self._bar = None
        if enabled and bar and stderr_is_terminal():
            from tqdm import tqdm

            # Under mpirun stderr is a pipe with no size: a fixed width, not dynamic.
            self._bar = tqdm(total=total, unit="step", ncols=100, file=sys.stderr)

    def update(self, step: int, text: str):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(text, refresh=False)
        elif step % self.log_every == 0:
            self.log.info("step %d %s", step, text)

    def message(self, text: str):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            self.log.info("%s", text)

    def close(self):
        if self._bar is not None:
            self._bar.close()
