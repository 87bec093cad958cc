"""``python -m scaleloop.launching.agent LOG_FILE TORCHRUN_ARGS...``: torchrun, its own messages in a file.

This is torchrun: ``torch.distributed.run``'s own parser and elastic agent, unchanged. Only
where the agent's own messages go differs: its log lines, its failure summary ("Root Cause
...") and its traceback go to LOG_FILE instead of the console, because scaleloop's launcher
reads the workers' error files and prints a short report instead. The workers still inherit
the console (rank 0 shows its progress there).

It holds its lifeline to the launcher (``scaleloop.launching.lifeline``) before anything else,
and so do its workers to it: a launcher killed outright takes torchrun and the workers along.
While it lives it counts as a writer of the launcher's run directory (``join_writers``).

It starts its workers as torchrun does: fresh interpreters, each importing torch itself. Nothing
on this path forks a process that has imported torch (a fork cannot use CUDA once the driver has
started, and it inherits every lock another thread held at the fork). It ends at once when
torchrun is done (:func:`leave`): the launcher is waiting for it.

Exit codes: 0 when every worker succeeded, 1 when one failed, 128 + N on signal N (Ctrl-C: 130).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Iterator, NoReturn, Optional, Sequence

# torchrun's loggers (the launcher, the elastic agent) and Python warnings raised in it.
_LOGGERS = ("torch.distributed", "torch.multiprocessing", "py.warnings")


def _log_to(path: str) -> None:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False


@contextlib.contextmanager
def logs_in(path: str) -> Iterator[None]:
    """While inside: torchrun's loggers write to ``path`` only; their handlers are put back after.

    For ``scaleloop.launch``, whose elastic agent is a fork of the caller (a notebook) that writes
    to its console: its failure messages and tracebacks would bury the short report the caller gets.
    """
    loggers = [logging.getLogger(name) for name in ("torch.distributed", "torch.multiprocessing")]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from scaleloop.launching import lifeline
    from scaleloop.output.lock import join_writers

    # First, before torch's slow import: a launcher that died meanwhile ends this process here.
    lifeline.hold()
    join_writers()
    if hasattr(signal, "SIGHUP"):
        # A closing terminal sends SIGHUP to the launcher's process group, this process included:
        # the launcher alone decides (it asks the workers to checkpoint and stop, see
        # scaleloop.runtime.preempt). Dying of it here would take the workers along at once.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m scaleloop.launching.agent LOG_FILE TORCHRUN_ARGS... (started by scaleloop's launcher)",
              file=sys.stderr)
        return 2
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _log_to(args[0])  # after the imports: importing torch sets up its own handlers
    # A message that finds its disk full is lost, not printed on the console with logging's own
    # traceback: the launcher says in one line that the run directory cannot be written.
    logging.raiseExceptions = False
    log = logging.getLogger("torch.distributed.run")
    try:
        torchrun.run(torchrun.parse_args(args[1:]))
    except ChildFailedError as exc:
        log.error("%s", exc.format_msg())
        return 1
    except SignalException as exc:
        log.warning("stopped by signal %s", exc.sigval)
        return 128 + int(exc.sigval)
    except Exception:  # the agent itself failed (rendezvous, bad arguments): its traceback, in the log
        log.exception("torchrun failed")
        return 1
    return 0


def leave(code: int) -> NoReturn:
    """End the agent now, once what it wrote is out.

    Only torchrun's code and this module's run in this process (the user's code runs in the
    workers), and all they write goes through logging and the two standard streams. Once those
    are flushed, the interpreter's own end would only free memory the system takes back anyway:
    about 0.2 CPU-second for a process that has imported torch, which the launcher waits for
    after the last worker has ended (``benchmarks/launch``).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):   # a console whose reader has gone
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
