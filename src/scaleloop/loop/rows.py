"""A row of ``metrics.csv`` (and of the tracker), and the health checks on each log row.

The trainer makes the rows (a log row every ``--log-every`` steps, an evaluation, an epoch's
end, a recovery); rank 0 writes them, and every rank reads a log row's all-reduced totals for
a straggling rank or a loss that is no longer finite (:func:`check_health`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from scaleloop.checkpoint.manager import Checkpointer
from scaleloop.loop.health import WindowTotals, stopped_on_nonfinite
from scaleloop.loop.result import RunResult


# Not frozen (as WindowTotals): a frozen dataclass is slower to make, and one is made at every log row.
@dataclass(slots=True)
class Row:
    """A row of ``metrics.csv`` (and of the tracker). Read-only."""

    kind: str                        # "step" (a log row), "epoch", "stop" (a run stopped inside an epoch), "recovery",
    #                                  "eval" (an evaluation every --eval-every steps)
    epoch: int                       # counted from 1, as in metrics.csv
    step: int
    samples: int
    values: dict[str, Any]           # the other columns (keys of output.metrics.METRIC_COLUMNS; None: empty)
    totals: Optional[WindowTotals] = None   # a log row's window, reduced over ranks
    steps: int = 0                   # a log row's steps in the window
    step_s: float = 0.0              # ... and their wall seconds per step


def check_health(row: Row, totals: WindowTotals, result: RunResult, checkpointer: Checkpointer, loader: Any) -> None:
    """On a log row's all-reduced ``totals`` (every rank alike): a straggling rank gets a line; a
    non-finite loss stops the run on every rank (after rank 0 wrote the row that shows it),
    naming the data (``loader``'s) when a sample of the step it began at is not finite."""
    straggler = result.stragglers.window(totals.own_s, row.steps, row.step_s, row.step)
    if straggler is not None:
        checkpointer.say(straggler.describe())
    if totals.samples > 0 and not math.isfinite(totals.loss):
        raise stopped_on_nonfinite(f"the training loss became {totals.loss}", totals.first_bad or row.step, row.epoch,
                                   result.out, checkpointer.last_step, totals.bad_ranks, len(totals.own_s), loader)
