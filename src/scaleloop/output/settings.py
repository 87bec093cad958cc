"""The config's output section: what a run writes besides its checkpoints, and its own checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.output.trackers import check_installed


@dataclass(frozen=True)
class OutputSettings:
    """The run directory, the metric rows, the progress bar and the tracker."""

    out: Optional[str] = None
    log_every: int = 10
    progress: bool = True
    tracker: str = "tensorboard"
    tensorboard: bool = True

    def check(self) -> None:
        if self.log_every < 1:
            raise UsageError("--log-every must be a positive integer")
        check_installed(self.tracker)   # a missing W&B/MLflow package: now, before the run directory exists
