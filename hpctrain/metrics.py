"""Where numbers go: <run-dir>/metrics.jsonl, TensorBoard scalars, and rank-0 progress.

Only rank 0 writes; every record is already reduced over ranks by the caller. Every JSONL
line carries the same core keys (event, epoch, step, loss, val_loss, val_accuracy,
samples_per_sec; null where not measured) so tools can read any line the same way.
"""

from __future__ import annotations

import json
import math
import sys
import time
import types
from pathlib import Path

CORE_KEYS = ("event", "epoch", "step", "loss", "val_loss", "val_accuracy", "samples_per_sec")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


class MetricsWriter:
    """JSONL + TensorBoard on rank 0; a no-op elsewhere."""

    def __init__(
        self, run_dir: Path | None, enabled: bool, jsonl: bool = True, tensorboard: bool = True
    ):
        self.enabled = enabled and run_dir is not None
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if tensorboard:
            # tensorboard imports TensorFlow when it is installed unless the module
            # tensorboard.compat.notf exists; its stub writes the same event files, and a
            # torch run should not pay 2 s and 500 MB for a TensorFlow it never uses.
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(str(run_dir / "tb"))

    def write(self, event: str, **fields) -> dict:
        record = {k: None for k in CORE_KEYS}
        record.update(event=event, time=round(time.time(), 3))
        record.update({k: _clean(v) for k, v in fields.items()})
        if not self.enabled:
            return record
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, sort_keys=False) + "\n")
        if self._tb is not None and record.get("step") is not None:
            self._scalars(event, record)
        return record

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
            self._tb.close()
            self._tb = None


class Progress:
    """A tqdm bar on rank 0 when stderr is a terminal; periodic log lines otherwise."""

    def __init__(self, enabled: bool, total: int, log, log_every: int, bar: bool = True):
        self.enabled = enabled
        self.log = log
        self.log_every = log_every
        self._bar = None
        if enabled and bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

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
