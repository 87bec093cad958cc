"""The record of an ending the loop decides itself, on rank 0, while it still holds the run
directory: a non-finite loss, a stop signal, a file it cannot write, bad input found while
training, Ctrl-C. (A failed or stalled rank is recorded by the launcher, which sees every rank.)"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.loop.health import Diverged
from scaleloop.output.endings import Failure
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.frames import where_of
from scaleloop.runtime.preempt import Preempted


def record_ending(run_dir: Optional[Path], exc: BaseException, step: int) -> None:
    """Write ``run_dir/failure.json`` for ``exc`` when it is one of the loop's own endings (see the
    module doc); nothing for another exception, or on a rank without the run directory.
    ``step``: the last global step trained."""
    if run_dir is None:
        return
    where = where_of(exc)
    if isinstance(exc, Diverged):
        record = Failure("diverged", exc.ranks[0] if len(exc.ranks) == 1 else None, exc.epoch, exc.step,
                         message=exc.what)
    elif isinstance(exc, Preempted):
        record = Failure("stopped", step=step, message=str(exc))
    elif isinstance(exc, RunDirWriteError):
        record = Failure("unwritable", epoch=where["epoch"], step=where["step"], message=str(exc),
                         during=where["during"])
    elif isinstance(exc, UsageError):
        record = Failure("usage", epoch=where["epoch"], step=where["step"], message=str(exc), during=where["during"])
    elif isinstance(exc, KeyboardInterrupt):
        record = Failure("interrupted", step=step, message="Ctrl-C (SIGINT) or SIGTERM")
    else:
        return
    record.error_type = type(exc).__name__
    record.report = [f"scaleloop: {record.message}"]
    record.write(run_dir)
