"""The config's output section: what a run writes besides its checkpoints, and its own checks.
Each field is declared once, here, with its help (``scaleloop.option``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from scaleloop.option import option, require
from scaleloop.output.trackers import TRACKERS, check_installed

_output = partial(option, group="output")
#: How many steps ``--profile`` alone profiles, and how many run before it records (the first
#: steps allocate, warm caches and build DDP's buckets: not the steady state).
PROFILE_STEPS, PROFILE_WARMUP = 3, 2


@dataclass(frozen=True)
class OutputSettings:
    """The metric rows, the progress bar and the tracker (the run directory is the checkpoint
    section's ``out``: where a run continues is decided there)."""

    log_every: int = _output(10, "optimizer steps between metric rows in metrics.csv")
    progress: bool = _output(True, "show a progress bar")
    tracker: str = _output("tensorboard", "where metrics go besides metrics.csv: TensorBoard events in "
                           "<run>/tensorboard (if installed), a W&B or MLflow run (see docs/tracking.md), or nowhere",
                           TRACKERS)
    tensorboard: bool = _output(True, "write the events of --tracker tensorboard (--no-tensorboard: as --tracker none)")
    #: Steps profiled with torch.profiler after the warm-up (``loop.profiler``); 0: off, and nothing
    #: of the profiler is imported. A config.toml written before this setting reads as 0.
    profile: int = option(0, f"profile this many steps after {PROFILE_WARMUP} warm-up steps with torch.profiler: a trace per rank, "
                          "a summary and a timeline in <run>/profile (docs/profiling.md); --profile alone: "
                          f"{PROFILE_STEPS} steps (default: 0, off)", group="speed", bare=PROFILE_STEPS)

    def check(self) -> None:
        require(self.log_every >= 1, "log_every", "a positive integer")
        require(self.profile >= 0, "profile", "a number of steps: 0 (off) or more (--profile alone: "
                f"{PROFILE_STEPS})")
        check_installed(self.tracker)   # a missing W&B/MLflow package: now, before the run directory exists
