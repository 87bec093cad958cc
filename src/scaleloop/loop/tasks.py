"""Loss and accuracy for each kind of target (see ``DataInfo.task``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from scaleloop.data.info import DataInfo


def loss_fn(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
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
