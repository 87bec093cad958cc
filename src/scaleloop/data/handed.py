"""What a ``torch.utils.data.DataLoader`` handed to ``strategy.loader`` says, in the loader's own terms.

A strategy's loader decides which samples each rank reads in each step (``data.sampler``: the same
samples for any number of processes), so it does not iterate the user's DataLoader: it takes from it

- the dataset (map-style, or a stream: an ``IterableDataset``);
- its ``batch_size``, as the GLOBAL batch of one optimizer step (split over the data-parallel
  ranks and the accumulation steps), not a per-rank batch;
- ``shuffle`` (a ``RandomSampler``) or not (a ``SequentialSampler``), ``drop_last``, ``collate_fn``,
  ``num_workers`` and ``persistent_workers``.

The order of a shuffled epoch is the strategy's, drawn from ``loader(..., seed=)`` (the same on every
rank and for every world size), not the DataLoader's generator; ``pin_memory``, ``prefetch_factor``,
``timeout`` and ``in_order`` change how, not what, batches arrive, and the strategy sets its own.
What it cannot honour is refused in one line that says what to pass (:func:`from_dataloader`): a
sampler or batch sampler of the user's own (it chooses the samples), no batch size, a
``worker_init_fn`` or ``multiprocessing_context``, a DataLoader subclass that iterates its own way,
or a keyword given to ``loader`` that contradicts the DataLoader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from scaleloop.errors import UsageError

_INSTEAD = ("pass strategy.loader a DataLoader built with a batch_size (the global batch) and shuffle=True or "
            "False, or the dataset and batch_size")


@dataclass(frozen=True)
class LoaderArgs:
    """``strategy.loader``'s arguments, as a DataLoader gave them (see the module docstring)."""

    dataset: Dataset
    batch_size: int
    shuffle: bool
    drop_last: bool
    num_workers: int
    collate_fn: Optional[Callable[[list], Any]]
    persistent_workers: bool


def from_dataloader(loader: DataLoader, *, batch_size: Optional[int] = None, shuffle: Optional[bool] = None,
                    drop_last: Optional[bool] = None, num_workers: Optional[int] = None,
                    collate_fn: Optional[Callable[[list], Any]] = None) -> LoaderArgs:
    """The loader arguments ``loader`` gives; a keyword given too must agree with it. UsageError
    (one line, saying what to pass) for what the strategy's loader cannot honour."""
    kind = type(loader).__name__
    if any(getattr(type(loader), method) is not getattr(DataLoader, method) for method in ("__iter__", "_get_iterator")):
        raise UsageError(f"strategy.loader cannot use {kind}: it iterates its own way, and the strategy reads the "
                         f"dataset itself; {_INSTEAD}")
    stream = isinstance(loader.dataset, IterableDataset)
    if loader.batch_size is None:
        raise UsageError(f"strategy.loader takes the DataLoader's batch_size as the global batch, and this one has "
                         f"none (a batch_sampler of its own, or batch_size=None); {_INSTEAD}")
    if not stream:
        _check_sampler(loader)
    for what, value in (("worker_init_fn", loader.worker_init_fn),
                        ("multiprocessing_context", loader.multiprocessing_context)):
        if value is not None:
            raise UsageError(f"strategy.loader cannot honour the DataLoader's {what} (it starts its own workers); "
                             f"build the DataLoader without it, or do that work in the dataset")
    took = LoaderArgs(dataset=loader.dataset, batch_size=loader.batch_size,
                      shuffle=not stream and isinstance(loader.sampler, RandomSampler),
                      drop_last=loader.drop_last, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      persistent_workers=loader.persistent_workers)
    for name, given in (("batch_size", batch_size), ("shuffle", shuffle), ("drop_last", drop_last),
                        ("num_workers", num_workers), ("collate_fn", collate_fn)):
        if given is not None and given != getattr(took, name):
            raise UsageError(f"strategy.loader got a DataLoader with {name}={getattr(took, name)!r} and "
                             f"{name}={given!r}: set it on the DataLoader, or pass the dataset instead")
    return took


def _check_sampler(loader: DataLoader) -> None:
    """The DataLoader samples as ``shuffle=True`` or ``False`` does, over its whole dataset: the only
    sampling the strategy's own reproduces (a batch sampler of its own has no batch_size: refused before)."""
    sampler = loader.sampler
    plain = (type(sampler) is SequentialSampler
             or (type(sampler) is RandomSampler and not sampler.replacement
                 and getattr(sampler, "_num_samples", None) is None))
    if not plain or getattr(sampler, "data_source", None) is not loader.dataset:
        split = (" (the strategy splits each global batch over the ranks itself: drop it)"
                 if "Distributed" in type(sampler).__name__ else "")
        raise UsageError(f"strategy.loader cannot honour the DataLoader's {type(sampler).__name__}{split}: the strategy "
                         f"chooses each step's samples itself, the same on any number of processes; {_INSTEAD} "
                         "(a subset as torch.utils.data.Subset)")
