"""``scaleloop train`` as one task of an ``srun`` step: what it says while it waits for the others.

A task cannot tell ``srun`` from a shell that still holds an earlier job's ``SLURM_*`` variables:
both look like rank R of N. So it says at once what it read (its first line), waits for the
other tasks with a time limit (``--timeout``), and ends that wait in one line: the tasks that
never came and what to do, or the signal that stopped it. ``--nproc N`` on the command line wins
over the variables, as it does over leftover ``RANK``/``WORLD_SIZE`` (``scaleloop.launching.jobs``):
then N workers start here.

No torch here: the launcher reads it before deciding whether to import anything slow.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator, MutableMapping, Optional

from scaleloop.errors import UsageError
from scaleloop.runtime.preempt import Preempted, signal_name
from scaleloop.runtime.slurm import SlurmTask

#: The signals that end the wait with a line (Ctrl-C ends it as an interruption, exit 130).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def first_line(task: SlurmTask, limit_s: float) -> str:
    """What the task read and what it waits for, e.g. ``srun task: rank 1 of 2 of SLURM job 1, step 0,
    rendezvous at localhost:15001 (read from SLURM_PROCID, ...); waiting up to 1800 s (--timeout) ...``."""
    others = "the other task" if task.world_size == 2 else f"the other {task.world_size - 1} tasks"
    return (f"srun task: {task.describe()}, rendezvous at {task.rendezvous} (read from {', '.join(task.read)}); "
            f"waiting up to {limit_s:g} s (--timeout) for {others}")


def ignored_line(task: SlurmTask, environ: MutableMapping[str, str], nproc: object) -> str:
    """``--nproc`` given to an srun task: the line that says its variables are ignored; they are
    removed from ``environ``, so that nothing started from here takes this process for that task."""
    names = ", ".join(f"{name}={environ[name]}" for name in task.read)
    for name in task.read:
        environ.pop(name, None)
    return f"note: ignoring {names} (an srun task's variables: {task.describe()}; --nproc {nproc} decides)"


def gave_up(exc: UsageError, task: SlurmTask) -> UsageError:
    """The line that ends a wait past the limit: who never came, and what to do."""
    return UsageError(f"{exc}: if no srun started this process, its SLURM variables are left from an earlier job: "
                      f"run `{task.unset_command()}` first, or give --nproc N to start N workers here (under srun, "
                      "the missing tasks' own output says why they did not come)")


def interrupted_words(task: SlurmTask) -> str:
    """What Ctrl-C during the wait leaves: nothing."""
    return f"nothing was trained ({task.describe()} was waiting for the other tasks at {task.rendezvous})"


@contextlib.contextmanager
def stops_said(task: SlurmTask) -> Iterator[None]:
    """While ``task`` waits for the others: SIGTERM or SIGHUP ends it in one line (:class:`Preempted`,
    exit 143) instead of killing it without a word. The handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        raise Preempted(f"stopped by {signal_name(signum)} while waiting for the other tasks of SLURM job "
                        f"{task.job or '?'}, step {task.step or '?'} at {task.rendezvous} (this process is rank "
                        f"{task.rank} of {task.world_size}); nothing was trained")

    before = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)

