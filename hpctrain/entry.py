"""The `hpctrain` console script and `python -m hpctrain`: `hpctrain.cli` behind a guard.

Why a module of its own that imports nothing: a Ctrl-C while Python imports the CLI (the
frameworks' shims, the command modules: a fraction of a second on every rank) raised
KeyboardInterrupt outside any handler of ours, and each rank printed a traceback of
import machinery. Here it ends the process with one line and the shell's code for SIGINT.
"""

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it (runtime/failfast.py's too)


def main() -> int:
    try:
        from .cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("hpctrain: interrupted (Ctrl-C) while starting\n")
        return EXIT_INTERRUPTED
