"""Faults for tests: a run's answers to "should I fail here?", off unless a test sets them.

A `Faults` is made once, where the process starts (`hpctrain train` / `hpctrain ps`, or
a test that builds a `TrainingLoop` itself), and handed down through constructors: the
loop, the checkpointer and checkpoint writes, the parameter-server worker. No module
reads it from a global. `Faults.none()` (the default everywhere) switches nothing on,
and every hook is then a `None` check and nothing else. Faults never show up in
metrics.jsonl or in checkpoints.

Each fault is a `(key, value)` pair: it acts only where the key matches (a world rank,
a parameter-server worker index, or 0 for faults with no key).

- `kill_during_save` (key 0): SIGKILL the writer after `value` datasets of a save (a
  number above the dataset count kills after the fsync, just before the rename).
- `write_delay` (key 0): a checkpoint write waits `value` seconds before writing (an
  async save's file is then written while training has moved on).
- `copy_delay` (key 0): an async save's deferred copy (the torch backend's views,
  copied during the next step) starts `value` seconds late.
- `die_at_step` (key: world rank): SIGKILL that rank after step `value` (first run only:
  the loop drops it on a resumed run).
- `step_sleep` (key: world rank): sleep `value` seconds after every step (first run only).
- `eval_sleep` (key: world rank): sleep `value` seconds before every validation batch
  (a long evaluation; first run only).
- `signal_at_start` (key: world rank): that rank sends itself signal `value` (2:
  SIGINT) once its strategy is built, before the run directory is touched (a Ctrl-C
  that reached one node only while the run started).
- `ps_silent` (key: worker index): that worker stops sending anything from step `value`.
- `ps_delay` (key: worker index): sleep `value` seconds before every push.
- `ps_slow` (key: worker index): make each step `value` times as long.

Test-only environment variables: a test that starts `hpctrain train` as a separate
process switches a fault on with `HPCTRAIN_FAULT_<NAME>=<key>:<value>` (upper-case
name, e.g. `HPCTRAIN_FAULT_DIE_AT_STEP=1:8`); the command-line entry point, and only
it, turns them into a `Faults` with `Faults.from_env` (docs/environment.md).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "HPCTRAIN_FAULT_"

Fault = tuple[int, float]  # (key, value)


@dataclass(frozen=True)
class Faults:
    """Which faults are switched on; all off by default (`Faults.none()`)."""

    kill_during_save: Fault | None = None
    write_delay: Fault | None = None
    copy_delay: Fault | None = None
    die_at_step: Fault | None = None
    step_sleep: Fault | None = None
    eval_sleep: Fault | None = None
    signal_at_start: Fault | None = None
    ps_silent: Fault | None = None
    ps_delay: Fault | None = None
    ps_slow: Fault | None = None

    @classmethod
    def none(cls) -> Faults:
        """No fault switched on: what every product run gets."""
        return NO_FAULTS

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        """The faults a test switched on through `HPCTRAIN_FAULT_<NAME>=<key>:<value>`
        (test-only; the command-line entry point calls this once)."""
        env = os.environ if env is None else env
        found = {}
        for name in cls.names():
            raw = env.get(PREFIX + name.upper(), "")
            if ":" in raw:
                key, value = raw.split(":", 1)
                found[name] = (int(key), float(value))
        return cls(**found) if found else NO_FAULTS

    def value(self, name: str, key: int = 0) -> float | None:
        """Fault `name`'s value when it is switched on for `key`, else None."""
        fault = getattr(self, name)
        if fault is None or int(fault[0]) != key:
            return None
        return float(fault[1])

    # --- hooks: each a no-op unless its fault is set -----------------------------------
    def after_step(self, rank: int, step: int) -> None:
        """The loop's hook after each step: `die_at_step`, then `step_sleep`."""
        die = self.value("die_at_step", rank)
        if die is not None and step == int(die):
            kill_self()
        sleep = self.value("step_sleep", rank)
        if sleep:
            time.sleep(sleep)

    def at_start(self, rank: int) -> None:
        """The loop's hook while the run starts: `signal_at_start`."""
        number = self.value("signal_at_start", rank)
        if number is not None:
            os.kill(os.getpid(), int(number))

    def kill_after_datasets(self) -> int | None:
        """`kill_during_save`: SIGKILL after this many datasets reached the temp file."""
        n = self.value("kill_during_save")
        return None if n is None else int(n)

    def sleep(self, name: str, key: int = 0) -> None:
        """Sleep for a delay fault (`write_delay`, `copy_delay`) when it is set."""
        seconds = self.value(name, key)
        if seconds:
            time.sleep(seconds)


NO_FAULTS = Faults()


def kill_self() -> None:
    """A fault's crash: no cleanup, no flush, exactly like kill -9 from outside."""
    os.kill(os.getpid(), signal.SIGKILL)


def fault_env(name: str, key: int, amount: float) -> dict[str, str]:
    """The environment variable a test sets to switch fault `name` on for `key` in a
    process it starts (read there by `Faults.from_env`)."""
    if name not in Faults.names():
        raise ValueError(f"unknown fault {name!r}; faults: {', '.join(Faults.names())}")
    return {PREFIX + name.upper(): f"{key}:{amount:g}"}
