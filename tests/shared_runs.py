"""Small comparison runs shared by a test session: every run registered for the same
(ranks, backend) is trained in one mpirun launch the first time a test asks for one of
them, then reused (like demo_runs.py). A launch costs 5-11 s on 2 cores (imports, MPI,
Horovod); one more small run in it under a second. Every run reseeds the process, so
sharing a launch changes no number.

A run registered with `extended=True` is needed only by tests marked `extended`: it is
trained only in a session that selected one of them (tests/conftest.py sets
`EXTENDED_SELECTED` once collection is done), so `make test` pays nothing for it."""

from __future__ import annotations

from pathlib import Path

EXTENDED_SELECTED = True  # conftest: False when the session selected no extended test


class SharedRuns:
    """`share(np, backend, name, *overrides)` at import; `get(...)` in a test.

    train_many(where, np, {name: overrides}, timeout=...) trains the runs of one launch
    and returns {name: result}; `last(overrides)` sorts runs to the end of their launch
    (Horovod, once started, stays in the process)."""

    def __init__(self, train_many, label: str, last=None):
        self.train_many, self.label, self.last = train_many, label, last
        self.runs: dict[tuple[int, str], dict[str, list[str]]] = {}
        self.extended: set[tuple[int, str, str]] = set()
        self._done: dict[tuple[int, str], tuple[Path, dict] | AssertionError] = {}

    def share(self, np_, backend, name, *overrides, extended=False) -> None:
        runs = self.runs.setdefault((np_, backend), {})
        assert name not in runs, f"two shared runs named {name} ({np_} ranks, {backend})"
        runs[name] = [f"backend={backend}", *overrides]
        if extended:
            self.extended.add((np_, backend, name))

    def get(self, tmp_path_factory, np_, backend, name, run_dir=False):
        """The result of the run `share` registered; run_dir=True: its directory."""
        key = (np_, backend)
        if key not in self._done:
            where = tmp_path_factory.mktemp(f"{self.label}{np_}-{backend}")
            runs = {
                n: o
                for n, o in self.runs[key].items()
                if EXTENDED_SELECTED or (np_, backend, n) not in self.extended
            }
            if self.last is not None:
                runs = dict(sorted(runs.items(), key=lambda r: self.last(r[1])))
            try:
                self._done[key] = where, self.train_many(where, np_, runs, timeout=600)
            except AssertionError as exc:
                self._done[key] = exc  # reported once, not relaunched by every test
                raise
        if isinstance(self._done[key], AssertionError):
            raise AssertionError(f"the shared {key} launch failed (first test)") from None
        where, results = self._done[key]
        return where / f"{name}.npz.run" if run_dir else results[name]
