"""The config's checkpoint section: the run directory, what the checkpoint floor is handed, and its
own checks (no torch). Each field is declared once, here, with its help (``scaleloop.option``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from scaleloop.option import option, require

_checkpoints = partial(option, group="checkpoints")


@dataclass(frozen=True)
class CheckpointSettings:
    """The run directory, where checkpoints go, how often, how many are kept, and which one a run
    continues from."""

    out: Optional[str] = option(None, "run directory (default: runs/<date>-<time>-<model>-<data>); an existing "
                                "run's directory continues that run", group="output", common=True)
    checkpoints: bool = _checkpoints(True, "write checkpoints to <run>/checkpoints (at every epoch end and every "
                                     "--checkpoint-every steps)")
    checkpoint_every: int = _checkpoints(0, "also checkpoint every N optimizer steps (0: only at epoch ends)")
    async_checkpoint: bool = _checkpoints(False, "write each checkpoint in a background thread while training goes "
                                          "on: the step only copies the state to host memory (one more copy of it "
                                          "while the write runs; docs/checkpointing.md)")
    keep_checkpoints: int = _checkpoints(3, "how many of the newest checkpoints to keep")
    resume: str = _checkpoints("auto", "auto: continue from the newest valid checkpoint in --out if there is one; "
                               "never; or a checkpoint/run directory to continue from")
    shared_fs: str = option("auto", "whether every machine sees the same run directory: auto (checked at the start), "
                            "yes, or no (every machine then keeps a verified copy of each checkpoint)",
                            ("auto", "yes", "no"), group="launch")

    def check(self) -> None:
        """UsageError naming the flag, for a value no run can use."""
        require(self.checkpoint_every >= 0, "checkpoint_every", "zero (epoch ends only) or a positive integer")
        require(self.keep_checkpoints >= 1, "keep_checkpoints",
                "a positive integer (use --no-checkpoints to write none)")
        require(bool(self.resume.strip()), "resume", "auto, never, or a checkpoint path")
