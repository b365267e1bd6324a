"""Errors a user can act on.

Anything derived from HpctrainError is a problem with the user's input or environment
(bad config, missing file, NaN loss...). The CLI prints it as one clear line on every
rank and exits with status 2; any other exception is a bug and aborts the whole job.
"""

import re


class HpctrainError(Exception):
    """A problem the user can fix; printed without a traceback.

    `agreed` is True once every rank is known to raise it (World.agree); an error only
    one rank raised must instead abort the job, or the other ranks would wait forever.
    """

    agreed = False


class ConfigError(HpctrainError):
    """An invalid configuration value (the message names the key)."""


class DataError(HpctrainError):
    """A missing, unreadable or inconsistent dataset."""


class CheckpointError(HpctrainError):
    """A checkpoint that cannot be written, found, verified or loaded."""


class LaunchError(HpctrainError):
    """The launcher's view of the job disagrees with MPI's, or a launch value is invalid."""


class TrainingDiverged(HpctrainError):
    """The loss became NaN or infinite."""


class StoppedBeforeStart(HpctrainError):
    """A stop the user asked for (Ctrl-C, SIGUSR2, a SIGTERM outside SLURM) while a run
    started: it ends before it changes anything, with the interrupt's exit status."""

    label = "stopped"

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RankErrors(HpctrainError):
    """Errors reported by one or more ranks, gathered so that every rank can print them all.

    Identical messages are grouped ("rank(s) 0-511: ..."), so a large job stays readable.
    With `merge_figures`, so are messages that differ in their figures only (the ranks of
    one data-parallel model each plan it with their own baseline): the lowest rank's is
    shown, and the ranks that gave other figures are named.
    """

    def __init__(self, errors: dict[int, str], merge_figures: bool = False, alone: bool = False):
        """alone: the job has one rank, whose message needs no "rank(s) 0:"."""
        self.errors = dict(sorted(errors.items()))
        if alone and len(self.errors) == 1:
            super().__init__(next(iter(self.errors.values())))
            return
        groups: dict[str, list[tuple[int, str]]] = {}
        for rank, msg in self.errors.items():
            key = _FIGURES.sub("#", msg) if merge_figures else msg
            groups.setdefault(key, []).append((rank, msg))
        lines = []
        for said in groups.values():
            first = said[0][1]
            other = [r for r, msg in said if msg != first]
            note = f" (rank(s) {rank_ranges(other)}: the same with other figures)" if other else ""
            lines.append(f"rank(s) {rank_ranges([r for r, _ in said])}: {first}{note}")
        super().__init__(lines[0] if len(lines) == 1 else "\n  " + "\n  ".join(lines))


_FIGURES = re.compile(r"\d+(?:[.,]\d+)*")


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' so that a 512-rank job's message stays one line."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def require_path(option: str, value: str, kind: str = "file") -> str:
    """`value` of a path option, or a ConfigError naming it: an empty (or blank) one is
    refused, not taken for the current directory (`--run-dir "$UNSET"`) or the
    filesystem's root (`--run-root ''` made run directories at ''/<job>)."""
    if not value.strip():
        raise ConfigError(f"{option} {value!r}: expected a {kind} path, not an empty one")
    return value
