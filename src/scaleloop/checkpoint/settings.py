"""The config's checkpoint section: what the checkpoint floor is handed, and its own checks (no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scaleloop.errors import UsageError


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go, how often, how many are kept, and which one a run continues from."""

    out: Optional[str] = None          # the run directory (None: not named yet)
    resume: str = "auto"               # auto, never, or a checkpoint or run directory
    checkpoints: bool = True
    checkpoint_every: int = 0          # optimizer steps between checkpoints inside an epoch (0: epoch ends only)
    keep_checkpoints: int = 3
    shared_fs: str = "auto"            # whether every machine sees the run directory: auto, yes, no
    seed: int = 0                      # a resumed rank's fresh RNG streams are seeded from it

    def check(self) -> None:
        """UsageError naming the flag, for a value no run can use."""
        if self.checkpoint_every < 0:
            raise UsageError("--checkpoint-every must be zero (epoch ends only) or a positive integer")
        if self.keep_checkpoints < 1:
            raise UsageError("--keep-checkpoints must be a positive integer (use --no-checkpoints to write none)")
        if not self.resume.strip():
            raise UsageError("--resume must be auto, never, or a checkpoint path")
