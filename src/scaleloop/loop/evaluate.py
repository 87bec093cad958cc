"""Exact evaluation: every test sample counted once, whatever the world size."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from scaleloop.data.info import DataInfo
from scaleloop.data.loader import _move, tensors_of
from scaleloop.runtime.collectives import sum_over_ranks
from scaleloop.strategies.base import Strategy
from scaleloop.loop.tasks import correct_count


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    samples: int


def evaluate(model: nn.Module, dataset: Dataset, info: DataInfo, strategy: Strategy,
             batch_size: int = 512) -> EvalResult:
    """Loss and accuracy over all of ``dataset``, the same for 1 or N ranks.

    Each rank walks the block that ``strategy.eval_shard`` gives it (data parallel: its
    contiguous ``shard_indices(len(dataset), env)``, no padding, so nothing is counted twice)
    in local batches of up to ``batch_size`` samples. Per-sample
    losses are summed in float64 rather than averaged per batch, so the totals do not depend
    on how the samples were cut into ranks and batches; the sums of loss, correct predictions
    and predictions are then added over ranks. ``loss`` is the mean per prediction (per token
    for language models), as in training.

    Every rank must call it. With a strategy whose forward pass is a collective (FSDP), ranks
    with fewer local batches run filler forwards (``eval_shard``'s ``fillers``) so that all
    ranks run the same number; their outputs are discarded.
    """
    env = strategy.env
    n = len(dataset)
    was_training = model.training
    model.eval()
    strategy.sync_buffers(model)
    mine, extra = strategy.eval_shard(n, batch_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    correct = total = 0
    with torch.no_grad():
        for x, y in _batches(dataset, mine, batch_size, env.device):
            out = strategy.eval_forward(model, x)
            if out is None:  # this rank computes no outputs (a pipeline's earlier stage)
                continue
            loss_sum += _loss_sum(info, out, y)
            c, t = correct_count(info, out, y)
            correct += c
            total += t
        if extra > 0:
            filler, _ = next(_batches(dataset, range(0, 1), 1, env.device))
            for _ in range(extra):
                strategy.eval_forward(model, filler)
    model.train(was_training)
    # A rank with no samples (fewer samples than ranks) still joins the reduction.
    sums = torch.stack([loss_sum, torch.tensor(float(correct), dtype=torch.float64, device=env.device),
                        torch.tensor(float(total), dtype=torch.float64, device=env.device)])
    sums = sum_over_ranks(sums, env)
    predictions = float(sums[2])
    if predictions == 0:
        return EvalResult(loss=float("nan"), accuracy=float("nan"), samples=n)
    return EvalResult(loss=float(sums[0]) / predictions, accuracy=float(sums[1]) / predictions, samples=n)


def _loss_sum(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``tasks.loss_fn``'s loss summed over the predictions, in float64.

    A float32 batch mean would round differently for differently composed batches (and so
    for different world sizes); per-sample losses are computed in at least float32 (half
    precision outputs are upcast, as in ``loss_fn``), then added up in float64.
    """
    out = output.to(torch.promote_types(output.dtype, torch.float32))
    if info.task == "binary":
        losses = F.binary_cross_entropy_with_logits(out, target.to(out.dtype).view_as(out), reduction="none")
    elif info.task == "lm":
        losses = F.cross_entropy(out.flatten(0, -2), target.flatten(), reduction="none")
    else:
        losses = F.cross_entropy(out, target, reduction="none")
    return losses.double().sum()


def _batches(dataset: Dataset, indices: range, batch_size: int,
             device: torch.device) -> Iterator[tuple[Any, Any]]:
    """``(x, y)`` for consecutive slices of ``indices``, on ``device``."""
    starts = range(indices.start, indices.stop, batch_size)
    tensors = tensors_of(dataset)
    if tensors is not None:
        x_all, y_all = tensors
        for s in starts:  # contiguous: slicing, no gather
            e = min(s + batch_size, indices.stop)
            yield x_all[s:e].to(device), y_all[s:e].to(device)
        return
    if not starts:  # a DataLoader cannot collate an empty batch
        return
    batches = [list(range(s, min(s + batch_size, indices.stop))) for s in starts]
    for x, y in DataLoader(dataset, batch_sampler=batches):
        yield _move(x, device, False), _move(y, device, False)
