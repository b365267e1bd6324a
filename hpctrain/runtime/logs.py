"""Rank-prefixed logging: every line says which rank wrote it.

`--verbose` also decides whether a user error shows its traceback (runtime.failfast).
"""

from __future__ import annotations

import logging
import sys

_verbose = False


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, size: int):
        super().__init__("%(asctime)s [rank %(rank)s] %(levelname)s %(message)s", "%H:%M:%S")
        self._rank = f"{rank}/{size}"

    def format(self, record):
        record.rank = self._rank
        return super().format(record)


def set_verbose(verbose: bool) -> None:
    global _verbose
    _verbose = bool(verbose)


def is_verbose() -> bool:
    """True under --verbose: every rank logs, and user errors show their traceback."""
    return _verbose


def setup_logging(rank: int, size: int, verbose: bool = False) -> logging.Logger:
    """Configure the 'hpctrain' logger: rank 0 at INFO, other ranks at WARNING unless verbose."""
    set_verbose(verbose or _verbose)
    logger = logging.getLogger("hpctrain")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RankFormatter(rank, size))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if (rank == 0 or verbose) else logging.WARNING)
    logger.propagate = False
    return logger
