"""Streams (``IterableDataset``s) for tests/data/test_streaming.py and
tests/distributed/test_streaming_dist.py, and for trying ``scaleloop train --data stream_data:build``
by hand (with ``tests/data`` on ``PYTHONPATH``).

Every stream here yields the same samples in every process; the order changes with the epoch
(``set_epoch``), drawn from the seed, as docs/streaming.md asks. A sample's id is written into
its first feature (``x[0] = id / 1000``), so a test can tell which sample a batch held.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset

from scaleloop.data.info import DataInfo, Datasets

N_TRAIN = 203   # 12 steps of 16 and a last step of 11
N_TEST = 61
DIM = 8


def sample_id(x: torch.Tensor) -> torch.Tensor:
    """The ids of a batch of inputs (see the module docstring)."""
    return (x[..., 0] * 1000).round().long()


class Stream(IterableDataset):
    """``n`` samples, as ``{"x", "labels"}`` mappings (``dicts``) or ``(x, y)`` pairs; shuffled
    per epoch from ``seed`` unless ``shuffle`` is False. ``target``: ``class`` (an int64 label),
    ``float`` (a float label of shape ``(1,)``) or ``pair`` (a float target of shape ``(2,)``)."""

    def __init__(self, n: int = N_TRAIN, seed: int = 0, *, shuffle: bool = True, dicts: bool = True,
                 target: str = "class") -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        self.x[:, 0] = torch.arange(n) / 1000
        score = self.x[:, 1:4].sum(1)
        self.y: torch.Tensor = {"class": (score > 0).long(), "float": (score > 0).float().unsqueeze(1),
                                "pair": torch.stack([score, -score], 1)}[target]
        self.seed, self.shuffle, self.dicts = seed, shuffle, dicts
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.x))
        return torch.randperm(len(self.x), generator=torch.Generator().manual_seed(1000 * self.seed + epoch))

    def __iter__(self) -> Iterator[Any]:
        for i in self.order(self.epoch).tolist():
            yield {"x": self.x[i], "labels": self.y[i]} if self.dicts else (self.x[i], self.y[i])


class SizedStream(Stream):
    """A stream with a ``__len__`` (which may be wrong: ``declared``)."""

    def __init__(self, *args: Any, declared: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.declared = len(self.x) if declared is None else declared

    def __len__(self) -> int:
        return self.declared


def build() -> Datasets:
    """A classification stream of mappings, and a stream test set; the number of classes given."""
    return Datasets(Stream(), Stream(N_TEST, seed=1, shuffle=False), DataInfo("stream", "classification", (DIM,), 2))


def sized() -> Datasets:
    """``build`` with a ``__len__`` on the training stream."""
    return Datasets(SizedStream(), Stream(N_TEST, seed=1, shuffle=False),
                    DataInfo("stream", "classification", (DIM,), 2))


def pairs() -> Stream:
    """A bare stream of ``(x, y)`` pairs with an int64 label: the number of classes is not known."""
    return Stream(dicts=False)


def floats() -> Stream:
    """A bare stream whose float labels of shape (1,) may be binary or a regression."""
    return Stream(target="float")


def regression() -> tuple[Stream, Stream]:
    """A regression stream of ``(x, y)`` pairs (float targets of shape (2,)) and its test stream: no
    ``DataInfo`` needed."""
    return Stream(target="pair", dicts=False), Stream(N_TEST, seed=1, shuffle=False, target="pair", dicts=False)


class StatefulStream(Stream):
    """A ``Stream`` that saves its place in a pass (``state_dict``/``load_state_dict``, the
    convention of Hugging Face ``datasets``' IterableDataset) and counts the samples it yields
    in this process (``yielded``), so a test can tell whether a resume read the pass again.

    ``cost``: busy-work per sample (a few float operations, repeated), for the resume benchmark.
    """

    yielded = 0   # class-wide: the loop's DataLoader may hold a copy of the dataset

    def __init__(self, *args: Any, cost: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cost = cost
        self.position = 0          # samples of the current pass yielded so far
        self._start = 0            # where the next pass starts (set by load_state_dict, used once)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._start = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, 0
        order = self.order(self.epoch).tolist()
        for self.position, i in enumerate(order[start:], start + 1):
            if self.cost:
                _busy(self.x[i], self.cost)
            StatefulStream.yielded += 1
            yield {"x": self.x[i], "labels": self.y[i]} if self.dicts else (self.x[i], self.y[i])


def _busy(x: torch.Tensor, cost: int) -> None:
    """Stands for decoding or tokenising a sample: ``cost`` small tensor operations."""
    for _ in range(cost):
        x = x * 1.0001


def stateful() -> Datasets:
    """``build`` with a stateful training stream."""
    return Datasets(StatefulStream(), Stream(N_TEST, seed=1, shuffle=False),
                    DataInfo("stream", "classification", (DIM,), 2))


def slow_stateful() -> Datasets:
    """A stateful stream of 20,000 samples at a small cost each, for the resume benchmark."""
    return Datasets(StatefulStream(20_000, cost=50), None, DataInfo("stream", "classification", (DIM,), 2))


def slow_stateless() -> Datasets:
    """The same stream without its state: a resume re-reads the pass."""
    stream = StatefulStream(20_000, cost=50)
    stream.state_dict = None   # type: ignore[assignment]   (so it is not stateful)
    return Datasets(stream, None, DataInfo("stream", "classification", (DIM,), 2))
