"""Batches for one rank, following a ``StepPlan``.

Two paths give the same batches:

- in-memory tensors (``TensorDataset`` and every built-in dataset): a batch is one
  ``index_select`` per tensor — no per-sample ``__getitem__`` and no collation;
- any other ``Dataset``: a ``torch.utils.data.DataLoader`` driven by the plan's index lists
  (so worker processes and custom collate functions still work).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from scaleloop.data.sampler import MicroBatch, StepPlan


class Batch(tuple):
    """``(x, y)`` that also knows where it sits in the plan (``batch.step``, ``batch.loss_scale``...).

    It unpacks like a tuple, so ``for x, y in loader`` works; pass the batch itself to
    ``strategy.backward(loss, batch)`` to weight a smaller last micro-batch exactly.
    """

    plan: MicroBatch

    def __new__(cls, x: Any, y: Any, plan: MicroBatch) -> "Batch":
        obj = super().__new__(cls, (x, y))
        obj.plan = plan
        return obj

    @property
    def step(self) -> int:
        return self.plan.step

    @property
    def last_micro(self) -> bool:
        return self.plan.last_micro

    @property
    def loss_scale(self) -> float:
        return self.plan.loss_scale

    @property
    def indices(self) -> torch.Tensor:
        return self.plan.indices

    def __len__(self) -> int:  # tuple length is 2; len(batch) means samples
        return int(self.plan.indices.numel())


def tensors_of(dataset: Dataset) -> Optional[Sequence[torch.Tensor]]:
    """The dataset's ``(x, y)`` tensors when it is an in-memory ``TensorDataset``, else None."""
    # A subclass that overrides __getitem__ (augmentation, transforms) must be read through
    # it, so only datasets that index their tensors exactly as TensorDataset does qualify.
    if getattr(type(dataset), "__getitem__", None) is not TensorDataset.__getitem__:
        return None
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2 and all(
            isinstance(t, torch.Tensor) for t in tensors):
        return tensors
    return None


def _move(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(o, device, non_blocking) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device, non_blocking) for k, v in obj.items()}
    return obj


class ShardedLoader:
    """Iterates this rank's micro-batches for the current epoch, already on ``device``."""

    def __init__(self, dataset: Dataset, plan: StepPlan, device: torch.device, *,
                 num_workers: int = 0, collate_fn: Optional[Callable[[list], Any]] = None,
                 pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.plan = plan
        self.device = device
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory and device.type == "cuda"
        self._tensors = tensors_of(dataset)
        self.epoch = 0
        self.start_step = 0

    @property
    def in_memory(self) -> bool:
        """True when batches are gathered straight from tensors (the fast path)."""
        return self._tensors is not None

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's order (same on every rank), optionally resuming at ``start_step``."""
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return self.plan.micro_batches_per_epoch(self.start_step)

    def __iter__(self) -> Iterator[Batch]:
        plans = list(self.plan.micro_batches(self.epoch, self.start_step))
        if self._tensors is not None:
            x_all, y_all = self._tensors
            for p in plans:
                x, y = x_all.index_select(0, p.indices), y_all.index_select(0, p.indices)
                yield Batch(x.to(self.device), y.to(self.device), p)
            return
        # A generator of its own: otherwise each DataLoader iterator draws its worker seed from
        # the global torch RNG, and a run resumed mid-epoch (one extra iterator) would drift
        # from the uninterrupted run's dropout and augmentation randomness.
        seeds = torch.Generator()
        seeds.manual_seed(hash((self.plan.seed, self.epoch, self.start_step, self.plan.rank)) & 0x7FFF_FFFF_FFFF)
        loader = DataLoader(self.dataset, batch_sampler=[p.indices.tolist() for p in plans],
                            num_workers=self.num_workers, collate_fn=self.collate_fn,
                            pin_memory=self.pin_memory, generator=seeds)
        for p, (x, y) in zip(plans, loader):
            yield Batch(_move(x, self.device, self.pin_memory), _move(y, self.device, self.pin_memory), p)
