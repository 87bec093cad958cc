"""Preemption signals: a cluster asks the run to stop, and the run stops cleanly with a checkpoint.

A scheduler takes a machine back with a signal and a grace period before ``SIGKILL``: SLURM sends
``SIGTERM`` (or the signal of ``sbatch --signal``), other schedulers similar. This module only
*listens*: a signal handler notes which signal came (and calls the callbacks given, e.g. a worker
muting its console) and returns at once, so the training step in progress is never cut. The loop
asks at each optimizer step's end whether a stop was requested and all ranks agree there
(``scaleloop.loop.pauses``), then write one checkpoint together and end with :class:`Preempted`.

Which signals mean "stop after this step" (:func:`stop_signals`):

- ``SIGUSR1`` and the one named by ``--signal`` always;
- ``SIGHUP`` in the process a terminal talks to (the launcher, or a run in one process; not a
  worker, not under SLURM): a closed terminal then ends the run with a checkpoint and a record
  that says so, instead of killing it without a word (torchrun's agent ignores it: the launcher
  passes it on as ``SIGUSR1``);
- ``SIGTERM`` too, except in a worker that torchrun started outside SLURM: there torchrun uses
  ``SIGTERM`` to end the survivors of a failed rank (and the worker dumps its stack on it, which is
  how a stalled rank is found), so scaleloop's launcher turns a ``SIGTERM`` it receives into
  ``SIGUSR1`` for its workers instead (``scaleloop.launching.torchrun``). Under SLURM every process
  of the job gets the scheduler's ``SIGTERM`` directly, so there it means preemption everywhere.

Signal handlers are process-wide by nature; the one record of a received signal is therefore
process-wide too (``_LISTENER``), and the only module state in scaleloop's runtime. No torch here.
"""
from __future__ import annotations

import shlex
import signal
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Callable, Iterable, Optional

from scaleloop.errors import UsageError

# The exit code of a run that stopped on request after writing its checkpoint: 128 + SIGTERM, as
# a process ended by SIGTERM, so schedulers and scripts read it as "terminated", not "failed".
EXIT_PREEMPTED = 143
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_number(name: str) -> signal.Signals:
    """``SIGUSR1``, ``USR1``, ``usr1`` or ``10`` as a signal; UsageError for one that cannot be caught."""
    text = name.strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UsageError(f"--signal {name!r} is not a signal name; use e.g. SIGUSR1, SIGUSR2 or SIGTERM") from None
    if sig.name in UNCATCHABLE:
        raise UsageError(f"--signal {sig.name} cannot be caught by a process; use e.g. SIGUSR1 or SIGTERM")
    return sig


def stop_signals(named: Optional[str], *, torchrun_worker: bool, slurm: bool) -> list[signal.Signals]:
    """The signals that ask this process to stop after the current step (rules in the module doc)."""
    sigs = [signal.SIGUSR1]
    if not torchrun_worker or slurm:
        sigs.append(signal.SIGTERM)
    if not torchrun_worker and not slurm and hasattr(signal, "SIGHUP"):
        sigs.append(signal.SIGHUP)
    if named:
        sig = signal_number(named)
        if sig not in sigs and not (sig == signal.SIGTERM and torchrun_worker and not slurm):
            sigs.append(sig)
    return sigs


@dataclass
class _Listener:
    received: Optional[int] = None
    installed: set[int] = field(default_factory=set)
    callbacks: list[Callable[[int], None]] = field(default_factory=list)

    def handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only notes the request: the step in progress finishes, then every rank agrees to stop.
        if self.received is None:
            self.received = signum
        for callback in self.callbacks:
            callback(signum)


_LISTENER = _Listener()


def listen(signals: Iterable[signal.Signals], on_signal: Optional[Callable[[int], None]] = None) -> list[int]:
    """Note the given signals from now on instead of dying of them; returns those newly taken over.

    Idempotent per signal. Off the main thread (where Python cannot set handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    if on_signal is not None:
        _LISTENER.callbacks.append(on_signal)
    new = []
    for sig in signals:
        if int(sig) in _LISTENER.installed:
            continue
        signal.signal(sig, _LISTENER.handle)
        _LISTENER.installed.add(int(sig))
        new.append(int(sig))
    return new


def requested() -> Optional[int]:
    """The first stop signal this process received (None: none)."""
    return _LISTENER.received


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``SIGHUP (terminal closed)`` for the signal a closing terminal sends."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return f"{name} (terminal closed)" if name == "SIGHUP" else name


class Preempted(Exception):
    """The run stopped on a signal after a checkpoint; the message is the one line to print."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def continue_command(run_dir: str) -> str:
    """The command that continues a stopped run from its newest checkpoint (its settings are saved
    in the run directory; see ``scaleloop.checkpoint.resume``)."""
    return f"scaleloop train --out {shlex.quote(run_dir)}"
