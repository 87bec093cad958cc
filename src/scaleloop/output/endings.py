"""How a run ended, when it did not finish: the record ``failure.json`` in its run directory.

Every ending other than a finished run leaves one, written by whoever knows the cause: the
launcher for a failed, stalled or interrupted group of workers (``scaleloop.launching.failures``)
and for a run that failed in its own process; the loop (rank 0) for the endings it decides
itself: a non-finite loss, a stop signal, a file it cannot write, bad input found while training.
``scaleloop doctor`` reads it; a run killed outright leaves none, which doctor reads as such.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

FAILURE_FILE = "failure.json"

#: The kinds of ending a record names (``docs/troubleshooting.md`` describes each).
KINDS = ("failed", "stalled", "interrupted", "diverged", "stopped", "unwritable", "usage")


@dataclass
class Failure:
    """What went wrong, as written to ``failure.json`` (``docs/troubleshooting.md`` lists the keys)."""

    kind: str                        # one of KINDS
    rank: Optional[int] = None       # the first failed rank, or the rank behind
    epoch: Optional[int] = None
    step: Optional[int] = None
    error_type: Optional[str] = None
    message: str = ""
    frame: Optional[str] = None      # the user's innermost frame, or where the stuck rank was
    waiting_in: Optional[str] = None
    during: Optional[str] = None     # what the loop did, when not a training step
    logs: dict[str, str] = field(default_factory=dict)
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    report: list[str] = field(default_factory=list)

    def write(self, run_dir: Path) -> None:
        """``run_dir/failure.json``, replaced atomically (a reader never sees half of it)."""
        path = run_dir / FAILURE_FILE
        tmp = path.with_name(f".{FAILURE_FILE}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the report was printed; a full or read-only disk must not hide it
