"""The run's evaluations: on what, and when.

On what: the whole test set (as ever), or with ``--eval-batches K`` a fixed sample of
``K x --batch-size`` of its samples; with ``--eval-train`` also such a sample of the training
set (all of it without ``--eval-batches``), evaluated as the test set is (evaluation mode, no
gradient). A sample is drawn once per run from ``--seed`` alone, never from the rank or the
world size, so every evaluation of a run reads the same samples, and 1 or N processes read the
same ones; :func:`~scaleloop.loop.evaluate.evaluate` then sums over them exactly. A stream has
no indices to draw from: its sample is its first ``K x --batch-size`` samples.

When: at each epoch's end (as ever) and with ``--eval-every N`` at global steps N, 2N, ...; a
resumed run continues at the next multiple of N, whatever step it resumes at.

An evaluation inside an epoch must not change what the run trains: it draws none of the
training's random numbers (a ``DataLoader`` over a set that is not in-memory tensors takes one
from the global generator, which dropout draws from too). The evaluation at an epoch's end is
left as it always was, so that runs without these flags stay bit for bit what they were.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from scaleloop.config.sections import EvalSettings
from scaleloop.data.batch import DictTensorDataset, TargetRoute, take, tensors_of
from scaleloop.data.info import DataInfo, Datasets
from scaleloop.data.streaming import declared_length
from scaleloop.errors import UsageError
from scaleloop.loop.evaluate import EvalResult, MetricFn, evaluate
from scaleloop.loop.tasks import LossFn
from scaleloop.strategies.base import Strategy

# Added to --seed for each set's sample: the two samples are drawn independently of each other.
TEST_SAMPLE_SEED = 0x5EED_7E57
TRAIN_SAMPLE_SEED = 0x5EED_7A19


def check_eval_data(settings: EvalSettings, data: Datasets) -> None:
    """UsageError when the evaluation flags ask for a test set the data does not have."""
    if has_samples(data.test) or settings.eval_train:
        return
    for name, value in (("--eval-every", settings.eval_every), ("--eval-batches", settings.eval_batches)):
        if value is not None:
            raise UsageError(f"{name} {value} evaluates the test set, and this data has none: give data with a test "
                             "set (--test-fraction for the built-in sets), or add --eval-train to evaluate a sample "
                             "of the training set")


def has_samples(dataset: Optional[Dataset]) -> bool:
    """Whether ``dataset`` is there and not empty (a stream of unknown length counts as there)."""
    return dataset is not None and declared_length(dataset) != 0


def sample_of(dataset: Dataset, samples: int, seed: int) -> Dataset:
    """``samples`` of ``dataset``'s samples, the same for a given ``seed`` in every process.

    Map-style: distinct indices drawn uniformly from ``seed`` (in the set's order); in-memory
    tensors are copied into a set of their own (the evaluation's fast path, slicing); another
    set is read through a ``Subset``. The whole set when it holds no more than ``samples``.
    A stream: its first ``samples`` samples.
    """
    if isinstance(dataset, IterableDataset):
        return StreamHead(dataset, samples)
    n = len(dataset)  # type: ignore[arg-type]
    if samples >= n:
        return dataset
    index = draw_indices(n, samples, seed)
    columns = tensors_of(dataset)
    if columns is None:
        return Subset(dataset, index.tolist())
    picked = take(columns, index)
    return DictTensorDataset(picked) if isinstance(picked, dict) else TensorDataset(*picked)


def draw_indices(n: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)``, uniformly drawn from ``seed``, in ascending order."""
    gen = torch.Generator().manual_seed(seed)
    if n <= max(4 * k, 1 << 22):
        return torch.randperm(n, generator=gen)[:k].sort().values
    # A permutation of a very large set (a token corpus) would cost gigabytes: draw with
    # replacement until there are k distinct ones, then keep k of them at random.
    picked = torch.empty(0, dtype=torch.int64)
    while len(picked) < k:
        picked = torch.unique(torch.cat([picked, torch.randint(n, (k,), generator=gen)]))
    return picked[torch.randperm(len(picked), generator=gen)[:k]].sort().values


class StreamHead(IterableDataset):
    """A stream's first ``samples`` samples (a stream's sample: it has no indices to draw from)."""

    def __init__(self, stream: IterableDataset, samples: int) -> None:
        self.stream, self.samples = stream, samples

    def __iter__(self) -> Iterator[Any]:
        for i, sample in enumerate(self.stream):
            if i >= self.samples:
                return
            yield sample


@contextlib.contextmanager
def own_rng(device: torch.device) -> Iterator[None]:
    """Random numbers drawn inside are the evaluation's own: the global generators (the CPU's
    and ``device``'s) are where they were afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


class Evaluations:
    """What the trainer evaluates and when (see the module's doc); one per run.

    The samples are drawn at the first evaluation and kept for the run.
    """

    def __init__(self, model: nn.Module, settings: EvalSettings, data: Datasets, strategy: Strategy, *,
                 batch_size: int, seed: int, loss_fn: Optional[LossFn], keep_target: TargetRoute,
                 metrics: dict[str, MetricFn]) -> None:
        self.model, self.settings, self.data, self.strategy = model, settings, data, strategy
        # The run's --batch-size and --seed (the optimizer section's): a sample's size and its draw.
        self.sample_size, self.seed = settings.sample_size(batch_size), seed
        self.every = settings.eval_every
        self._options: dict[str, Any] = dict(loss_fn=loss_fn, keep_target=keep_target)
        self._metrics = metrics
        self._sets: dict[str, tuple[Dataset, Optional[int]]] = {}

    @property
    def info(self) -> DataInfo:
        return self.data.info

    def due(self, step: int) -> bool:
        """Whether global step ``step`` has an evaluation of its own (a multiple of ``--eval-every``)."""
        return self.every is not None and step % self.every == 0

    def test(self, *, isolated: bool = False) -> Optional[EvalResult]:
        """The test set's (or its sample's) loss, accuracy and metrics; None without a test set.
        ``isolated``: drawing none of the training's random numbers (inside an epoch)."""
        if not has_samples(self.data.test):
            return None
        with own_rng(self.strategy.env.device) if isolated else contextlib.nullcontext():
            return self._evaluate("test", metrics=self._metrics)

    def train(self) -> Optional[EvalResult]:
        """With ``--eval-train``: the training set's (or its sample's) loss in evaluation mode,
        drawing none of the training's random numbers; None without it."""
        if not self.settings.eval_train or not has_samples(self.data.train):
            return None
        with own_rng(self.strategy.env.device):
            return self._evaluate("train", metrics={})

    def _evaluate(self, split: str, metrics: dict[str, MetricFn]) -> EvalResult:
        dataset, whole = self._set(split)
        result = evaluate(self.model, dataset, self.info, self.strategy, metrics=metrics, **self._options)
        return dataclasses.replace(result, of=whole) if whole is not None and whole > result.samples else result

    def _set(self, split: str) -> tuple[Dataset, Optional[int]]:
        """The split's evaluation set (drawn once) and the whole split's size when it is a sample."""
        if split not in self._sets:
            full = self.data.test if split == "test" else self.data.train
            assert full is not None
            size = self.sample_size
            seed = self.seed + (TEST_SAMPLE_SEED if split == "test" else TRAIN_SAMPLE_SEED)
            chosen = full if size is None else sample_of(full, size, seed)
            n = declared_length(full)
            self._sets[split] = (chosen, n if chosen is not full and n is not None else None)
        return self._sets[split]

    def describe(self) -> Optional[str]:
        """The header's line on the evaluations, where a flag changed them (else None)."""
        s = self.settings
        if s.eval_every is None and s.eval_batches is None and not s.eval_train:
            return None
        when = f"every {s.eval_every} steps and at each epoch's end" if s.eval_every else "at each epoch's end"
        parts = [f"the test set's loss on {self._what('test')}"] if has_samples(self.data.test) else []
        if s.eval_train:
            parts.append(f"the training loss in evaluation mode on {self._what('train')}")
        return f"evaluation {when}: " + "; ".join(parts)

    def _what(self, split: str) -> str:
        """Which samples of ``split`` an evaluation reads, in words."""
        full = self.data.test if split == "test" else self.data.train
        size, n = self.sample_size, declared_length(full)
        if size is None:
            return "all of it"
        if isinstance(full, IterableDataset):
            return f"the stream's first {size:,} samples"
        if n is not None and n <= size:
            return f"all of it ({n:,} samples: no more than --eval-batches asks for)"
        return f"a fixed sample of {size:,} of its {n:,} samples"
