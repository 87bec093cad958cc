"""Errors that reach the user as one line and an exit code, never as a traceback."""
from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user (flag, config file, name, size).

    The CLI prints ``scaleloop: error: <message>`` and exits with code 2. The message says
    what is wrong and what to do instead, in one line.
    """

    exit_code = 2
    shown = False   # True once printed (rank 0 of ``--nproc`` workers): the CLI then does not repeat it
