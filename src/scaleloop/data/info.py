"""What a model needs to know about a dataset, and the bundle a dataset builder returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from torch.utils.data import Dataset

Task = Literal["classification", "binary", "regression", "lm", "none"]


@dataclass(frozen=True)
class DataInfo:
    """Shape of one sample and the kind of target.

    - ``classification``: x has ``input_shape``; y is an int64 class index in ``[0, num_classes)``.
    - ``binary``: y is a float tensor of shape ``(K,)`` holding 0.0 or 1.0 (``K == 1``: one label;
      more: multi-label); ``num_classes == K``, the model's output width.
    - ``lm``: x and y are int64 token tensors of shape ``(seq_len,)`` (y is x shifted by one);
      ``input_shape == (seq_len,)`` and ``num_classes`` is the vocabulary size.
    - ``regression``: y is a float tensor (any shape); the loss is the mean squared error and
      ``num_classes`` is the number of values per sample (the model's output width).
    - ``none``: the samples carry no target; the model returns its own loss.

    ``input_shape`` is the shape of the sample's first input tensor. ``num_classes`` is None when
    it is not known: a classification or lm dataset that neither declares it (a ``num_classes`` or
    ``vocab_size`` attribute) nor holds its tensors in memory, since start-up reads one sample
    only; the model's output width is then the number of classes.
    """

    name: str
    task: Task
    input_shape: tuple[int, ...]
    num_classes: Optional[int]


@dataclass
class Datasets:
    """A training set, an optional held-out test set, and their ``DataInfo``."""

    train: Dataset
    test: Optional[Dataset]
    info: DataInfo
    #: What reading the data decided that the run's header should say (one line each).
    notes: list[str] = field(default_factory=list)
