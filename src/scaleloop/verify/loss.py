"""The loss a verify run trains with: the built-in one for the data's task, or the user's own.

A user loss is given as ``--loss pkg.module:fn`` with ``fn(output, target) -> loss``. It must
follow the same contract as the built-in losses: a scalar, the MEAN over the micro-batch's
samples. scaleloop weights each micro-batch's loss by its share of the global step before
backward, which makes N ranks x K micro-steps equal one process exactly when the loss of a
batch is the sample-weighted mean of the losses of its pieces. A loss normalised any other
way (a sum, a mean over each micro-batch's own valid tokens) breaks that, and
``probes.loss_split`` says which way.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError
from scaleloop.plugins import resolve_factory
from scaleloop.loop.tasks import loss_fn

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss(spec: Optional[str], info: DataInfo) -> Criterion:
    """``fn(output, target) -> scalar loss``: the user's ``pkg.module:fn``, or the built-in for ``info``."""
    if spec is None:
        return lambda output, target: loss_fn(info, output, target)
    fn = resolve_factory(spec, "loss")

    def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"--loss {spec!r} returned {shape}, not a scalar tensor; "
                             "return the mean loss over the batch")
        return loss.reshape(())

    return criterion
