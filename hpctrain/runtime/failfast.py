"""Fail together, and say why once: an error on any rank ends the whole job within seconds.

- A user error (HpctrainError) every rank has agreed on (World.agree) is printed once,
  by rank 0 (the agreed message names the ranks it concerns), and every rank exits
  with status 2 by itself: no MPI_Abort, so no Open MPI abort banner and no copy per
  rank. The traceback is shown only with --verbose.
- A user error only one rank knows about must not leave the others waiting in their
  next collective: that rank prints its one line and calls MPI_Abort with status 3, not
  2: such an error (an unreadable file on one node's filesystem, a full local disk) may
  pass, and `hpctrain elastic` restarts what ends with 3 but never what ends with 2.
- Anything else is a bug or a crash inside a framework: the failing rank prints its
  traceback once, then MPI_Abort ends every rank with a non-zero exit code.
- Ctrl-C outside training (where runtime.preemption turns it into a checkpoint and a
  clean stop) ends the job with status 130, after one line.

At 1,024 or 4,096 ranks an agreed error still prints one message (rank 0's), and
costs the agreement that found it (one allreduce of a flag, then an allgather).
"""

from __future__ import annotations

import sys
import threading
import traceback

from ..errors import HpctrainError
from .logs import is_verbose, set_verbose
from .world import world_if_started

EXIT_USER_ERROR = 2  # every rank agreed: the same run would fail the same way again
EXIT_RANK_ERROR = 3  # one rank's own user error (MPI_Abort): a restart may get past it
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell tool reading into `| head` returns


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


def _traceback_of(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def user_error_text(exc: HpctrainError, verbose: bool) -> str:
    """The one line (plus the traceback under --verbose) a user error prints."""
    text = f"{getattr(exc, 'label', 'error')}: {exc}"
    return f"{text}\n{_traceback_of(exc)}" if verbose else text


def _stdout_has_no_reader() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on
    the writing end), so that a BrokenPipeError from elsewhere stays a crash."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's flush at exit would hit the closed
    pipe again and print a traceback (the recipe of Python's signal module docs)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout: nothing to flush
        pass


def run_fail_together(fn, *args, **kwargs) -> int:
    """Run `fn`; agreed user errors exit 2 on each rank, anything else aborts the job."""
    threading.excepthook = _thread_excepthook
    if args and getattr(args[0], "verbose", False):  # the CLI's parsed arguments
        set_verbose(True)
    try:
        result = fn(*args, **kwargs)
        sys.stdout.flush()  # a closed pipe is found here, inside the handlers below
        return 0 if result is None else int(result)
    except HpctrainError as exc:
        w = world_if_started()
        text = user_error_text(exc, is_verbose())
        if w is not None and w.size > 1 and not exc.agreed:
            # Only this rank knows about the problem: the others must not wait for it.
            w.abort(text, EXIT_RANK_ERROR)
        sys.stdout.flush()
        # An error agreed while the World was being built has no registered World yet:
        # the agreement recorded this rank on the exception.
        rank = w.rank if w is not None else getattr(exc, "rank", None)
        if rank in (None, 0) or is_verbose():
            tag = _rank_tag() if w is not None or rank is None else f"[rank {rank}/{exc.size}]"
            sys.stderr.write(f"{tag} {text}\n")
            sys.stderr.flush()
        return getattr(exc, "exit_code", EXIT_USER_ERROR)
    except KeyboardInterrupt:
        _abort_with("interrupted (Ctrl-C)", EXIT_INTERRUPTED)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any crash must end every rank
        # stdout's reader left (`hpctrain ckpt inspect F | head`); another pipe or
        # socket that broke is a crash like any other
        if isinstance(exc, BrokenPipeError) and _stdout_has_no_reader():
            w = world_if_started()
            if w is None or w.size == 1:  # nothing waits for this process: end quietly
                _discard_stdout()
                return EXIT_BROKEN_PIPE
            _abort_with("standard output closed by its reader (broken pipe)")
        _abort_with("uncaught exception:\n" + traceback.format_exc().rstrip())
    return 1
