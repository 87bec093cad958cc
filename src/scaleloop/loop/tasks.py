"""Loss and accuracy for each kind of target (see ``DataInfo.task``), and the user's own loss.

Every loss a run trains with is a ``loss_fn(output, target)`` returning the MEAN loss over the
batch's samples: the step weights each micro-batch by its share of the global step, which
makes N ranks x K micro-steps equal one process only for a sample-weighted mean (see
docs/verification.md for losses normalised otherwise).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError

#: ``loss_fn(output, target) -> scalar tensor``, the mean over the batch.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss(spec: Optional[str], info: DataInfo) -> LossFn:
    """The user's ``pkg.module:fn`` (checked to return a scalar), or the built-in loss for ``info``."""
    if spec is None:
        return lambda output, target: task_loss(info, output, target)
    from scaleloop.plugins import resolve_factory

    fn = resolve_factory(spec, "loss")

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"--loss {spec!r} returned {shape}, not a scalar tensor; "
                             "return the mean loss over the batch")
        return loss.reshape(())

    return loss_fn


def task_loss(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the batch: cross-entropy, binary cross-entropy on logits, or next-token CE."""
    if info.task == "binary":
        return F.binary_cross_entropy_with_logits(output.float(), target.float().view_as(output))
    if info.task == "lm":
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())
    return F.cross_entropy(output.float(), target)


def correct_count(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions made) — tokens for ``lm``, samples otherwise."""
    if info.task == "binary":
        pred = (output > 0).to(target.dtype).view_as(target)
        return int((pred == target).sum()), target.numel()
    pred = output.argmax(dim=-1)
    return int((pred == target).sum()), target.numel()
