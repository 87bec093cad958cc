"""The learning rate: scaled to the global batch, warmed up, and scheduled over the run's steps.

The schedule is a plain ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer step,
so its state is the scheduler's own ``state_dict`` (saved in every checkpoint).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from scaleloop.config import TrainConfig


@dataclass(frozen=True)
class LearningRate:
    """The peak learning rate a run uses, and a sentence saying where it came from."""

    peak: float
    why: str


def scaled_lr(cfg: TrainConfig) -> LearningRate:
    """``--lr`` scaled from ``--base-batch-size`` to the global ``--batch-size``.

    Linear scaling keeps the size of an epoch's total update when the batch grows (k times the
    batch, k times fewer steps, so k times the step); sqrt scaling keeps the gradient noise
    scale instead and is the usual choice for Adam-like optimizers at large batches.
    """
    if cfg.lr_scaling == "none" or cfg.base_batch_size is None:
        return LearningRate(cfg.lr, "--lr as given")
    ratio = cfg.batch_size / cfg.base_batch_size
    factor = ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio)
    rule = f"{cfg.batch_size}/{cfg.base_batch_size}" if cfg.lr_scaling == "linear" else f"sqrt({cfg.batch_size}/{cfg.base_batch_size})"
    return LearningRate(cfg.lr * factor, f"{cfg.lr:g} x {rule}: {cfg.lr_scaling} scaling from "
                                         f"--base-batch-size {cfg.base_batch_size} to the global batch {cfg.batch_size}")


def lr_factor(step: int, *, schedule: str, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    after = step - warmup_steps
    span = max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, after / span)))
    if schedule == "step":
        return 0.1 ** sum(after >= span * frac for frac in (0.5, 0.75))
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``total_steps`` optimizer steps for ``cfg.lr_schedule`` and ``cfg.warmup_steps``.

    The optimizer's learning rate must already be the peak (see :func:`scaled_lr`).
    """
    def factor(step: int) -> float:
        return lr_factor(step, schedule=cfg.lr_schedule, total_steps=total_steps,
                         warmup_steps=cfg.warmup_steps)

    return _Schedule(optimizer, factor, constant=cfg.lr_schedule == "constant" and not cfg.warmup_steps)


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


def describe_schedule(cfg: TrainConfig, lr: LearningRate, total_steps: int) -> str:
    """One line for the run's log and summary."""
    parts = [f"{lr.peak:g} ({lr.why})"]
    if cfg.warmup_steps:
        parts.append(f"{cfg.warmup_steps} warm-up steps")
    if cfg.lr_schedule != "constant":
        parts.append(f"{cfg.lr_schedule} schedule over {total_steps} steps")
    return ", ".join(parts)
