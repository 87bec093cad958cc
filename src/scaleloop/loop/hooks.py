"""What the loop does besides training, at a step's end or at a row: hooks, wired once per run.

The :class:`Trainer` (``scaleloop.loop.training``) calls each event only for the hooks that
override it; the hooks here are the run's own: :class:`MetricsRows`, :class:`HealthChecks`,
:class:`StopOnSignal` and, after a fault, :class:`RecoveryReport`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from scaleloop.loop.health import WindowTotals, diverged
from scaleloop.loop.preempt import StopVote
from scaleloop.output.metrics import MetricsLogger
from scaleloop.runtime.recovery import RECOVERY_FILE, Recovery


class TrainerView(Protocol):
    """What a hook sees of the trainer (``scaleloop.loop.training.Trainer`` is one)."""

    ledger: Any                      # the counts so far (``training.Ledger``)
    checkpointer: Any                # ``checkpoint.manager.Checkpointer``
    run_dir: Optional[Path]          # rank 0's run directory (None on the other ranks)
    say: Callable[[str], None]       # a line on rank 0's console

    def emit(self, row: "Row") -> None: ...


# Not frozen (as WindowTotals): a frozen dataclass is slower to make, and one is made at every log row.
@dataclass(slots=True)
class Row:
    """A row of ``metrics.csv`` (and of the tracker), as the loop hands it to the hooks. Read-only."""

    kind: str                        # "step" (a log row), "epoch", "stop" (a run stopped inside an epoch), "recovery",
    #                                  "eval" (an evaluation every --eval-every steps)
    epoch: int                       # counted from 1, as in metrics.csv
    step: int
    samples: int
    values: dict[str, Any]           # the other columns (keys of output.metrics.METRIC_COLUMNS; None: empty)
    totals: Optional[WindowTotals] = None   # a log row's window, reduced over ranks
    steps: int = 0                   # a log row's steps in the window
    step_s: float = 0.0              # ... and their wall seconds per step


class Hook:
    """Something the loop does besides training, at a step's end or at a row.

    Subclass it and override the events you need; the trainer (``scaleloop.loop.training.Trainer``) calls a hook only at
    the events its class overrides, and an event no hook overrides costs the loop nothing.
    Each rank has its own list (the metrics rows and a recovery report are rank 0's); a hook
    that every rank has is called at the same steps on all of them, so it may take a collective.
    ``epoch`` counts from 0, as the loop does (a :class:`Row`'s from 1, as ``metrics.csv``).
    """

    def first_step(self, trainer: TrainerView, epoch: int) -> None:
        """Once, right after this process's first optimizer step (before its log row)."""

    def after_step(self, trainer: TrainerView, epoch: int) -> bool:
        """After every optimizer step, once its log row is written and ``--max-steps`` checked.

        True stops the run after this step, as ``--max-steps`` does (the epoch's ``stop`` row and
        checkpoint follow); it must be True on every rank alike.
        """
        return False

    def on_row(self, trainer: TrainerView, row: Row) -> None:
        """At each row: a log row every ``--log-every`` steps, an evaluation, an epoch's end, a recovery."""


def overrides(hook: Hook, event: str) -> bool:
    """Whether ``hook``'s class overrides ``event`` (the trainer calls it only then)."""
    return getattr(type(hook), event) is not getattr(Hook, event)


def chain(calls: list[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
    """One callable for an event's hooks, or None where there are none (the loop then skips the
    event with one ``is not None``); with one hook, that hook's own bound method."""
    if not calls:
        return None
    if len(calls) == 1:
        return calls[0]

    def every(*args: Any) -> bool:
        stop = False
        for call in calls:   # every one, whatever an earlier one returned: a stop vote is a collective
            if call(*args):
                stop = True
        return stop
    return every


class MetricsRows(Hook):
    """Writes the rows to ``metrics.csv`` and the tracker (rank 0: it owns the run directory)."""

    def __init__(self, metrics: MetricsLogger) -> None:
        self._write = {"step": metrics.log_step, "epoch": metrics.log_epoch, "stop": metrics.log_stop,
                       "recovery": metrics.log_recovery, "eval": metrics.log_eval}

    def on_row(self, trainer: TrainerView, row: Row) -> None:
        self._write[row.kind](epoch=row.epoch, step=row.step, samples=row.samples, **row.values)


class HealthChecks(Hook):
    """At each log row, on its all-reduce: a straggling rank gets a line, and a non-finite loss
    stops the run on every rank alike (after the metrics row that shows it, so come after
    :class:`MetricsRows`)."""

    def on_row(self, trainer: TrainerView, row: Row) -> None:
        totals = row.totals
        if totals is None:
            return
        ledger, checkpointer = trainer.ledger, trainer.checkpointer
        straggler = ledger.stragglers.window(totals.own_s, row.steps, row.step_s, row.step)
        if straggler is not None:
            checkpointer.say(straggler.describe())
        if totals.samples > 0 and not math.isfinite(totals.loss):
            raise diverged(f"the training loss became {totals.loss}", totals.first_bad or row.step, row.epoch,
                           ledger.out, checkpointer.last_step, totals.bad_ranks, len(totals.own_s))


class StopOnSignal(Hook):
    """The preemption stop vote (``scaleloop.loop.preempt``): every rank stops after the same step."""

    def __init__(self, vote: StopVote) -> None:
        self.vote = vote

    def after_step(self, trainer: TrainerView, epoch: int) -> bool:
        return self.vote.after_step(trainer.ledger.step)


class RecoveryReport(Hook):
    """After a fault, at the first step (the recovery is complete there): a line, a ``recovery``
    row and an entry of ``recovery.json``. Only a group that torchrun restarted has one."""

    def __init__(self, recovery: Recovery) -> None:
        self.recovery = recovery

    def first_step(self, trainer: TrainerView, epoch: int) -> None:
        recovery, run_dir = self.recovery, trainer.run_dir
        recovery.first_step = time.time()
        trainer.say(f"scaleloop: {recovery.describe()}")
        # Called before the step's samples are counted: the row's samples are those trained
        # before the fault's restart, as metrics.csv has always recorded them.
        trainer.emit(Row("recovery", epoch + 1, trainer.ledger.step, trainer.ledger.samples,
                         dict(world_size=recovery.world_after, recovery_s=recovery.phases["total_s"])))
        if run_dir is not None:
            try:
                recovery.write(run_dir)
            except OSError as exc:
                trainer.say(f"warning: {run_dir / RECOVERY_FILE} could not be written: {exc}")
