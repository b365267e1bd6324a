"""Fault injection for tests: the one place product code asks "should I fail here?".

Tests switch a fault on with an environment variable `HPCTRAIN_FAULT_<NAME>` (upper
case) holding `key:value`; product code asks `value(name, key)` at the point where the
fault acts and gets the number, or None when the fault is off (the default: a dict
lookup, nothing else). Faults never show up in metrics.jsonl or in checkpoints.

Faults in use:
- `kill_during_save` (key: 0): SIGKILL the writer after `value` datasets of a save.
- `ps_silent` (key: worker index): that worker stops sending anything from step `value`.
- `ps_delay` (key: worker index): sleep `value` seconds before every push.
- `ps_slow` (key: worker index): make each step `value` times as long.
- `die_at_step` (key: world rank): SIGKILL that rank after step `value`, unless resumed.
- `step_sleep` (key: world rank): sleep `value` seconds after every step, unless resumed.
- `write_delay` (key: 0): a checkpoint writer waits `value` seconds before writing
  (an async save's file is then written while training has moved on).
- `copy_delay` (key: 0): an async save's deferred copy (the torch backend's views,
  copied during the next step) starts `value` seconds late.
"""

from __future__ import annotations

import os

PREFIX = "HPCTRAIN_FAULT_"


def value(name: str, key: int = 0) -> float | None:
    """The fault's value for `key` when switched on for it, else None."""
    raw = os.environ.get(PREFIX + name.upper(), "")
    if ":" not in raw:
        return None
    k, v = raw.split(":", 1)
    return float(v) if int(k) == key else None


def env(name: str, key: int, amount: float) -> dict[str, str]:
    """The environment variable a test sets to switch fault `name` on for `key`."""
    return {PREFIX + name.upper(): f"{key}:{amount:g}"}
