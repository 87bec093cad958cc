"""Exact evaluation: every test sample counted once, whatever the world size."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from scaleloop.data.info import DataInfo
from scaleloop.data.loader import ShardedLoader
from scaleloop.data.sampler import StepPlan
from scaleloop.strategies.base import Strategy
from scaleloop.tasks import correct_count, loss_fn


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    samples: int


def evaluate(model: nn.Module, dataset: Dataset, info: DataInfo, strategy: Strategy,
             batch_size: int = 512) -> EvalResult:
    """Loss and accuracy over all of ``dataset``.

    The set is treated as one big "step" split into contiguous per-rank blocks (no padding,
    so nothing is counted twice), which each rank walks in local batches; the sums of loss,
    correct predictions and counts are then added over ranks.
    """
    env = strategy.env
    n = len(dataset)
    local_batches = max(1, -(-n // (batch_size * env.world_size)))
    plan = StepPlan(n, n, world_size=env.world_size, rank=env.rank,
                    accumulate=min(local_batches, max(1, n // env.world_size)), shuffle=False)
    loader = ShardedLoader(dataset, plan, env.device)
    # With fewer test samples than ranks some ranks hold none; they still join the reduction
    # below, but skip loading (a DataLoader cannot collate an empty batch).
    mine = sum(mb.indices.numel() for mb in plan.micro_batches(0))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    correct = total = 0
    with torch.no_grad():
        for x, y in (loader if mine else ()):
            if y.shape[0] == 0:
                continue
            with strategy.autocast():
                out = model(x)
            loss_sum += loss_fn(info, out, y).double() * y.shape[0]
            c, t = correct_count(info, out, y)
            correct += c
            total += t
    model.train(was_training)
    sums = torch.stack([loss_sum, torch.tensor(float(correct), dtype=torch.float64, device=env.device),
                        torch.tensor(float(total), dtype=torch.float64, device=env.device)])
    sums = strategy.reduce_sum(sums)
    samples = n
    loss = float(sums[0]) / samples
    accuracy = float(sums[1]) / max(1.0, float(sums[2]))
    return EvalResult(loss=loss, accuracy=accuracy, samples=samples)
