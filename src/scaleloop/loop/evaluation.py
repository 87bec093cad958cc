"""Exact evaluation: every test sample counted once, whatever the world size; and how it scores a
model: the task's loss summed over ranks exactly, its correct predictions, and the user's own
metrics (``--metrics``). Training's losses are ``loop.losses``.

The run's evaluations: on what, and when.

On what: the whole test set (as ever), or with ``--eval-batches K`` a fixed sample of
``K x --batch-size`` of its samples; with ``--eval-train`` also such a sample of the training
set (all of it without ``--eval-batches``), evaluated as the test set is (evaluation mode, no
gradient). A sample is drawn once per run from ``--seed`` alone, never from the rank or the
world size, so every evaluation of a run reads the same samples, and 1 or N processes read the
same ones; :func:`evaluate` then sums over them exactly. A stream has
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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from scaleloop.config.sections import EvalSettings
from scaleloop.data.batch import DictTensorDataset, TargetRoute, first_tensor, move, split, take, tensors_of
from scaleloop.data.info import DataInfo, Datasets
from scaleloop.data.streaming import StreamEval, declared_length
from scaleloop.errors import UsageError
from scaleloop.loop.losses import LossFn, own_loss, prediction_of
from scaleloop.runtime.collectives import sum_over_ranks
from scaleloop.strategies.base import Strategy


# --- scoring: how an evaluation scores a model --------------------------------------------
#: ``metric(prediction, target) -> tensor``: one value per sample, or the batch's mean.
MetricFn = Callable[[torch.Tensor, Any], torch.Tensor]


def resolve_metrics(spec: Optional[str]) -> dict[str, MetricFn]:
    """The user's metrics, ``pkg.module:fn[,pkg.module:fn2...]``, by the function's name."""
    if not spec:
        return {}
    from scaleloop.plugins import resolve_factory

    metrics: dict[str, MetricFn] = {}
    for one in (part.strip() for part in spec.split(",") if part.strip()):
        fn = resolve_factory(one, "metrics")
        name = getattr(fn, "__name__", one.rsplit(":", 1)[-1])
        metrics[name if name not in metrics else one] = _checked_metric(one, fn)
    return metrics


def _checked_metric(spec: str, fn: Callable[..., Any]) -> MetricFn:
    def metric(prediction: torch.Tensor, target: Any) -> torch.Tensor:
        value = fn(prediction, target)
        if not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"--metrics {spec!r} returned {type(value).__name__}; return a tensor of one value "
                                 "per sample, or the batch's mean") from None
        if value.dim() > 1 or (value.dim() == 1 and len(value) not in (1, len(prediction))):
            raise UsageError(f"--metrics {spec!r} returned a tensor {list(value.shape)} for a batch of "
                             f"{len(prediction)}; return one value per sample, or the batch's mean")
        return value

    return metric


def task_loss_sum(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the task's loss summed over the batch's predictions in float64, predictions): tokens for
    ``lm``, samples otherwise (a regression sample's loss is the mean over its values, as in training).

    Per-prediction losses are computed in at least float32, then added up in float64, so the
    total does not depend on how the samples were cut into ranks and batches.
    """
    out = output.to(torch.promote_types(output.dtype, torch.float32))
    if info.task == "binary":
        losses = F.binary_cross_entropy_with_logits(out, target.to(out.dtype).view_as(out), reduction="none")
    elif info.task == "lm":
        target = target.flatten()
        losses = F.cross_entropy(out.flatten(0, -2), target, reduction="none")[target != -100]  # -100: no target
    elif info.task == "regression":
        losses = F.mse_loss(out, target.to(out.dtype).view_as(out), reduction="none").reshape(len(out), -1).mean(1)
    else:
        losses = F.cross_entropy(out, target, reduction="none")
    return losses.double().sum(), losses.numel()


def correct_count(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions made) — tokens for ``lm``, samples otherwise; (0, 0)
    for regression, which has no accuracy."""
    if info.task == "regression":
        return 0, 0
    if info.task == "binary":
        pred = (output > 0).to(target.dtype).view_as(target)
        return int((pred == target).sum()), target.numel()
    pred = output.argmax(dim=-1)
    counted = target != -100  # cross-entropy's ignore index: padding
    return int(((pred == target) & counted).sum()), int(counted.sum())


# --- evaluation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float                  # NaN where the task has none (regression, a model's own loss)
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)   # the user's, over every sample
    of: Optional[int] = None         # the whole set's size when only a sample of it was evaluated


def evaluate(model: nn.Module, dataset: Dataset, info: DataInfo, strategy: Strategy,
             batch_size: int = 512, *, loss_fn: Optional[LossFn] = None, keep_target: TargetRoute = False,
             metrics: Optional[dict[str, MetricFn]] = None) -> EvalResult:
    """Loss, accuracy and the user's ``metrics`` over all of ``dataset``, the same for 1 or N ranks.

    Each rank walks the block that ``strategy.eval_shard`` gives it (data parallel: its
    contiguous ``shard_indices(len(dataset), env)``, no padding, so nothing is counted twice)
    in local batches of up to ``batch_size`` samples. Sums, not batch means, are added up in
    float64 and then over ranks, so the totals do not depend on how the samples were cut into
    ranks and batches. ``loss`` is the mean per prediction (per token for language models) of
    the task's loss; with the user's ``loss_fn``, or a model that returns its own loss, it is
    the mean over samples of that loss's batch means, weighted by batch size. A metric
    ``fn(prediction, target)`` gives one value per sample (averaged over samples) or a batch
    mean (weighted by batch size). ``keep_target``: a mapping sample's target entry is passed
    to the model (see ``scaleloop.data.batch``).

    Every rank must call it. With a strategy whose forward pass is a collective (FSDP), ranks
    with fewer local batches run filler forwards (``eval_shard``'s ``fillers``) so that all
    ranks run the same number; their outputs are discarded.

    A stream (an ``IterableDataset``) is read whole by every rank, in chunks of ``batch_size``
    samples that ``eval_shard`` splits as it splits a map-style set (``data.streaming.StreamEval``).
    """
    env = strategy.env
    stream = StreamEval(dataset, strategy.eval_shard, batch_size) if isinstance(dataset, IterableDataset) else None
    metrics = metrics or {}
    was_training = model.training
    model.eval()
    strategy.sync_buffers(model)
    # loss sum, predictions, correct, predictions judged for accuracy, samples, then the metrics' sums
    sums = torch.zeros(5 + len(metrics), dtype=torch.float64, device=env.device)
    with torch.no_grad():
        for x, y, counted in _rank_batches(dataset, stream, strategy, batch_size, env.device, keep_target):
            out = strategy.eval_forward(model, x)
            if out is None or not counted:  # no outputs here (a pipeline's earlier stage), or a filler
                continue
            sums += _batch_sums(info, out, y, _samples(x, y), loss_fn, metrics).to(sums.device)
    model.train(was_training)
    n = len(dataset) if stream is None else stream.samples  # type: ignore[arg-type]
    # A rank with no samples (fewer samples than ranks) still joins the reduction.
    sums = sum_over_ranks(sums, env).tolist()
    loss_sum, predictions, correct, judged, samples = sums[:5]
    if predictions == 0:
        return EvalResult(loss=float("nan"), accuracy=float("nan"), samples=n)
    return EvalResult(loss=loss_sum / predictions, accuracy=correct / judged if judged else float("nan"), samples=n,
                      metrics={name: value / samples for name, value in zip(metrics, sums[5:])})


def _samples(inputs: Any, target: Any) -> int:
    """Samples in a batch: the length of its target, or of its first input tensor."""
    first = target if isinstance(target, torch.Tensor) else first_tensor(inputs)
    return len(first) if first is not None and first.dim() else 1


def _batch_sums(info: DataInfo, output: Any, target: Any, n: int, loss_fn: Optional[LossFn],
                metrics: dict[str, MetricFn]) -> torch.Tensor:
    """One batch's (of ``n`` samples) loss sum, predictions, correct, judged, samples and metric
    sums (float64)."""
    own = own_loss(output) if loss_fn is None else None
    prediction = prediction_of(output) if (target is not None or metrics) else None
    if loss_fn is not None or own is not None:
        batch_mean = loss_fn(output, target) if loss_fn is not None else own
        loss_sum, predictions = float(batch_mean.double().mean()) * n, n
    else:
        loss_total, predictions = task_loss_sum(info, prediction, target)
        loss_sum = float(loss_total)
    correct = judged = 0
    # A model's own loss may shift or mask its targets (a causal LM's next-token loss): then only a
    # prediction per sample (classification, binary) is judged against the target as it is.
    judge = info.task in ("classification", "binary") or (info.task == "lm" and own is None)
    if prediction is not None and target is not None and judge:
        correct, judged = correct_count(info, prediction, target)
    values = [loss_sum, predictions, correct, judged, n]
    for fn in metrics.values():
        value = fn(prediction, target).detach().double()
        values.append(float(value.sum()) if value.dim() and len(value) == n else float(value.mean()) * n)
    return torch.tensor(values, dtype=torch.float64)


def _rank_batches(dataset: Dataset, stream: Optional[StreamEval], strategy: Strategy, batch_size: int,
                  device: torch.device, keep_target: TargetRoute) -> Iterator[tuple[Any, Any, bool]]:
    """This rank's ``(inputs, target, counted)`` on ``device``; not counted: a filler forward."""
    if stream is not None:
        for sample, counted in stream:
            yield (*split(move(sample, device), keep_target), counted)
        return
    mine, extra = strategy.eval_shard(len(dataset), batch_size)  # type: ignore[arg-type]
    for x, y in _batches(dataset, mine, batch_size, device, keep_target):
        yield x, y, True
    if extra > 0:
        filler, _ = next(_batches(dataset, range(0, 1), 1, device, keep_target))
        for _ in range(extra):
            yield filler, None, False


def _batches(dataset: Dataset, indices: range, batch_size: int, device: torch.device,
             keep_target: TargetRoute) -> Iterator[tuple[Any, Any]]:
    """``(inputs, target)`` for consecutive slices of ``indices``, on ``device``."""
    starts = range(indices.start, indices.stop, batch_size)
    columns = tensors_of(dataset)
    if columns is not None:
        for s in starts:  # contiguous: slicing, no gather
            e = min(s + batch_size, indices.stop)
            part = ({k: t[s:e] for k, t in columns.items()} if isinstance(columns, dict)
                    else tuple(t[s:e] for t in columns))
            yield split(move(part, device), keep_target)
        return
    if not starts:  # a DataLoader cannot collate an empty batch
        return
    batches = [list(range(s, min(s + batch_size, indices.stop))) for s in starts]
    for sample in DataLoader(dataset, batch_sampler=batches):
        yield split(move(sample, device), keep_target)


# --- what the run evaluates, and when -------------------------------------------------------------

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

    def of_test_set(self, *, isolated: bool = False) -> Optional[EvalResult]:
        """The test set's (or its sample's) loss, accuracy and metrics; None without a test set.
        ``isolated``: drawing none of the training's random numbers (inside an epoch)."""
        if not has_samples(self.data.test):
            return None
        with own_rng(self.strategy.env.device) if isolated else contextlib.nullcontext():
            return self._evaluate("test", metrics=self._metrics)

    def of_training_set(self) -> Optional[EvalResult]:
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
