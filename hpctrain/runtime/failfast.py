"""Fail together: an error on any rank ends the whole job within seconds.

Unexpected exceptions (bugs, crashes inside a framework) on one rank would otherwise
leave every other rank blocked forever in its next collective. `run_fail_together`
prints the failing rank's traceback once, then calls MPI_Abort, which mpirun/srun turn
into the termination of every rank with a non-zero exit code.

User errors (HpctrainError) that every rank has agreed on (see World.agree) are not
aborts: each rank prints the one-line message and exits with status 2 by itself.
"""

from __future__ import annotations

import sys
import threading
import traceback

from ..errors import HpctrainError
from .world import world_if_started

EXIT_USER_ERROR = 2


def _rank_tag() -> str:
    w = world_if_started()
    return f"[rank {w.rank}/{w.size}]" if w is not None else "[hpctrain]"


def _abort_with(text: str, code: int = 1) -> None:
    w = world_if_started()
    if w is not None and w.size > 1:
        w.abort(text, code)
    sys.stderr.write(f"{_rank_tag()} FATAL: {text}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """A crashed helper thread (prefetcher, async checkpoint writer) ends the job too."""
    if args.exc_type is SystemExit:
        return
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    _abort_with(f"uncaught exception in thread {args.thread.name if args.thread else '?'}:\n{text}")


def run_fail_together(fn, *args, **kwargs) -> int:
    """Run `fn`; agreed user errors exit 2 on each rank, anything else aborts the job."""
    threading.excepthook = _thread_excepthook
    try:
        result = fn(*args, **kwargs)
        return 0 if result is None else int(result)
    except HpctrainError as exc:
        w = world_if_started()
        if w is not None and w.size > 1 and not exc.agreed:
            # Only this rank knows about the problem: the others must not wait for it.
            w.abort(f"error: {exc}", EXIT_USER_ERROR)
        sys.stdout.flush()
        sys.stderr.write(f"{_rank_tag()} error: {exc}\n")
        sys.stderr.flush()
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _abort_with("interrupted", 130)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - any crash must end every rank
        _abort_with("uncaught exception:\n" + traceback.format_exc().rstrip())
    return 1
