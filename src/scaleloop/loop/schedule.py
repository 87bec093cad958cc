"""The learning rate: scaled to the global batch, warmed up, and scheduled over the run's steps.

The schedule is a plain ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer step,
so its state is the scheduler's own ``state_dict`` (saved in every checkpoint).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from scaleloop.config.sections import OptimSettings


@dataclass(frozen=True)
class LearningRate:
    """The peak learning rate a run uses, and a sentence saying where it came from."""

    peak: float
    why: str


def scaled_lr(optim: OptimSettings) -> LearningRate:
    """``--lr`` scaled from ``--base-batch-size`` to the global ``--batch-size``
    (:attr:`OptimSettings.peak_lr`), with a sentence saying how."""
    if optim.lr_scaling == "none" or optim.base_batch_size is None:
        return LearningRate(optim.lr, "--lr as given")
    rule = f"{optim.batch_size}/{optim.base_batch_size}" if optim.lr_scaling == "linear" else f"sqrt({optim.batch_size}/{optim.base_batch_size})"
    return LearningRate(optim.peak_lr, f"{optim.lr:g} x {rule}: {optim.lr_scaling} scaling from "
                                       f"--base-batch-size {optim.base_batch_size} to the global batch {optim.batch_size}")


def lr_factor(step: int, *, schedule: str, total_steps: int, warmup_steps: int, floor: float = 0.0) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    ``floor``: ``--min-lr`` as a share of the peak; cosine decays from 1 to it (0: to zero, as
    before the floor existed, bit for bit), step's drops stop at it.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    after = step - warmup_steps
    span = max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * min(1.0, after / span))))
    if schedule == "step":
        return max(floor, 0.1 ** sum(after >= span * frac for frac in (0.5, 0.75)))
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSettings,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``total_steps`` optimizer steps for ``optim.lr_schedule``, ``optim.warmup_steps``
    and ``optim.min_lr``.

    The optimizer's learning rate must already be the peak (see :func:`scaled_lr`); ``--min-lr``
    is a share of it.
    """
    peak = optimizer.param_groups[0]["lr"]
    # (An optimizer at lr 0, as bench's cost-only runs make, has no rate to keep a share of.)
    floor = optim.min_lr / peak if optim.min_lr and peak > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, schedule=optim.lr_schedule, total_steps=total_steps,
                         warmup_steps=optim.warmup_steps, floor=floor)

    return _Schedule(optimizer, factor, constant=optim.lr_schedule == "constant" and not optim.warmup_steps)


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """A ``LambdaLR`` (same behaviour, same ``state_dict``) whose ``step`` only counts when the
    schedule is constant: the rate it would set is the one the optimizer already has, and the
    step runs once per optimizer step, inside the timed loop."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float], *,
                 constant: bool) -> None:
        self.constant = constant
        super().__init__(optimizer, factor)

    def step(self, epoch: Optional[int] = None) -> None:
        if self.constant and epoch is None and self._step_count > 1:
            # LambdaLR would set every group's rate to base_lr x 1.0 (unchanged) and count.
            self._step_count += 1
            self.last_epoch += 1
            return
        super().step(epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("constant", None)   # the schedule comes from the config, not the checkpoint
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        constant = self.constant
        super().load_state_dict(state_dict)
        self.constant = constant


def describe_schedule(optim: OptimSettings, lr: LearningRate, total_steps: int) -> str:
    """One line for the run's log and summary."""
    parts = [f"{lr.peak:g} ({lr.why})"]
    if optim.warmup_steps:
        parts.append(f"{optim.warmup_steps} warm-up steps")
    if optim.lr_schedule != "constant":
        parts.append(f"{optim.lr_schedule} schedule over {total_steps} steps")
        if optim.min_lr:
            parts.append(f"down to --min-lr {optim.min_lr:g}")
        elif optim.lr_schedule == "cosine":
            parts.append("down to 0")
    return ", ".join(parts)
