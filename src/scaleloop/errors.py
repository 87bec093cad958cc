"""Errors that reach the user as one line and an exit code, never as a traceback."""
from __future__ import annotations

EXIT_USAGE = 2          # bad input: a flag, a file, a name, a size
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class UsageError(Exception):
    """Bad input from the user (flag, config file, name, size).

    The CLI prints ``scaleloop: error: <message>`` and exits with code 2. The message says
    what is wrong and what to do instead, in one line.
    """

    exit_code = EXIT_USAGE
    shown = False   # True once printed (rank 0 of ``--nproc`` workers): the CLI then does not repeat it


class StoppedOnEveryRank(UsageError):
    """An ending that every rank of a run raises alike, at the same step, from one collective's
    result (a loss or data that is not finite). Rank 0 records and says it; the other ranks wait
    for that before they exit, since torchrun ends every worker once one has exited."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""
