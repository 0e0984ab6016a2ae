"""Every command's exit when its reader goes away first (``hisparsectl stats | head -1``).

Python ignores SIGPIPE, so a write into a pipe nobody reads any more raises
``BrokenPipeError``, and its traceback (or an "Exception ignored" line at
exit, when the last flush fails) lands on the terminal. ``run_main`` ends
the command quietly instead, with the status a Unix tool killed by SIGPIPE
reports, as ``cat`` or ``yes`` would under ``| head``. The daemon keeps
Python's SIGPIPE handling: its own sockets must never kill it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141: what a shell reports for `yes | head -1`'s yes


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """``main(argv)``, then a flush of stdout; a closed pipe ends it with ``EXIT_BROKEN_PIPE``."""
    try:
        try:
            return main(argv)
        finally:
            # Here, not at exit, where a failure is reported as "Exception ignored";
            # also after argparse's --help, which ends in SystemExit.
            sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can reach the reader; point stdout at /dev/null so that
        # the interpreter's own flush at exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
