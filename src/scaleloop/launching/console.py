"""The console of a run that keeps training when the reader of its output goes away.

``scaleloop train ... | head``: once ``head`` has stopped reading, the next print raises
``BrokenPipeError``. In one rank of several that ended the rank's run alone, and the others then
waited for it in their next collective; in a one-process run it ended the training early, as a
failure (exit code 1, ``failure.json``). A run's output is also in its files (``metrics.csv``, ``logs/``), so the console's
writes simply go nowhere from then on, and training goes on. A write that finds its disk full (a
rank's output goes to its log file) is dropped alike.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from typing import Any, Iterator


class Console(io.RawIOBase):
    """File descriptor ``fd`` as a raw stream whose writes, once its reader has gone, go nowhere."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.gone = False   # the reader went away: nothing more is written

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        # A terminal stays one: the progress bar and the summary's width ask.
        try:
            return os.isatty(self.fd)
        except OSError:
            return False

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if not self.gone:
            try:
                return os.write(self.fd, data)
            except BrokenPipeError:
                self.gone = True
            except OSError as exc:
                # A rank's output that goes to its log (scaleloop.launching.worker) on a full disk:
                # this write is lost, not the rank (the run says the disk is full where it needs
                # room itself). A later write may find room again.
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        return size


def console_stream(fd: int, like: Any, errors: str) -> io.TextIOWrapper:
    """A text stream over ``Console(fd)``, written through, in ``like``'s encoding."""
    return io.TextIOWrapper(Console(fd), write_through=True, encoding=getattr(like, "encoding", None) or "utf-8",
                            errors=errors)


@contextlib.contextmanager
def kept_console() -> Iterator[None]:
    """While the block runs, ``sys.stdout`` and ``sys.stderr`` write through :class:`Console` when
    they are this process's own file descriptors (left as they are when something captures them).

    In a Ray Train worker, Ray's ``print`` owns the console: see :func:`scaleloop.ray.printed_once`."""
    from scaleloop.ray import in_ray_train_worker, printed_once

    if in_ray_train_worker():
        with printed_once():
            yield
        return
    saved = sys.stdout, sys.stderr
    if any(getattr(stream, "console_kept", False) for stream in saved):
        # A worker's streams to the console and its log (launching.worker): their console is kept
        # already, and the log must go on getting the lines (rank 0's log would get none).
        yield
        return
    try:
        out, err = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is an OSError and a ValueError
        yield
        return
    for stream in saved:
        try:
            stream.flush()
        except BrokenPipeError:
            pass
    sys.stdout = console_stream(out, saved[0], saved[0].errors or "strict")
    sys.stderr = console_stream(err, saved[1], "backslashreplace")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
