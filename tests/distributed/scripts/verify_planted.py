"""Bugs planted in user models and losses for scaleloop verify's tests (``--model planted:NAME``)."""
from __future__ import annotations

import atexit
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaleloop import DictTensorDataset


def _width(info: Any) -> int:
    return math.prod(info.input_shape)


class Mlp(nn.Module):
    def __init__(self, info: Any) -> None:
        super().__init__()
        self.body = nn.Linear(_width(info), 16)
        self.head = nn.Linear(16, info.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class FeatureEma(Mlp):
    """An EMA of the features that only evaluation would use, updated from each rank's own samples."""

    def __init__(self, info: Any) -> None:
        super().__init__(info)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.head(h)


class Unseeded(Mlp):
    """Initial weights from a generator seeded afresh in every process (not from --seed)."""

    def __init__(self, info: Any) -> None:
        super().__init__(info)
        g = torch.Generator()
        g.seed()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


class AbortsAtExit(Mlp):
    """Trains like Mlp, but rank 1 of a distributed run ends with exit code 3 after its work is done."""

    def __init__(self, info: Any) -> None:
        super().__init__(info)
        if os.environ.get("RANK") == "1":
            atexit.register(os._exit, 3)


def loss_over_world(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean loss divided by the world size by hand (1 in one process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return F.cross_entropy(output, target) / world


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class PrivateNoise(Mlp):
    """Noise on the features from a generator of the model's own, seeded from the rank."""

    def __init__(self, info: Any) -> None:
        super().__init__(info)
        self.noise = torch.Generator().manual_seed(100 + _rank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.training:
            h = h + 0.1 * torch.randn(h.shape, generator=self.noise)
        return self.head(h)


class ReseedsPerRank(Mlp):
    """Dropout after seeding the global generator from the rank, in every forward pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1000 + _rank())
        return self.head(F.dropout(self.features(x), 0.3, self.training))


class RankBranch(Mlp):
    """Rank 1 scales its features: code that branches on the rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if dist.is_initialized() and dist.get_rank() == 1:
            h = h * 1.5
        return self.head(h)


class _Augmented(torch.utils.data.Dataset):
    num_classes = 4

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(self.x[i].shape), self.y[i]   # the global generator


def augmented() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """Images augmented with noise from the global generator as each sample is read."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 1, 8, 8, generator=g), torch.randint(0, 4, (160,), generator=g)
    return _Augmented(x[:128], y[:128]), _Augmented(x[128:], y[128:])


class _AugmentedByIndex(_Augmented):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 + i)   # the advice verify gives: seeded by the index
        return self.x[i] + 0.05 * torch.randn(self.x[i].shape, generator=g), self.y[i]


def augmented_by_index() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """The same augmentation, drawn from a generator seeded by the sample's index."""
    train, test = augmented()
    return _AugmentedByIndex(train.x, train.y), _AugmentedByIndex(test.x, test.y)
VOCAB = 32


class TokenMeanLM(nn.Module):
    """A causal LM of one's own that takes ``labels`` and returns its loss as the mean over the
    batch's real (not -100) next tokens, as Hugging Face models do, but cannot be told a count:
    over padding, each micro-batch divides by its own count, and N ranks cannot train what one does."""

    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"logits": logits, "loss": loss}


def padded_lm() -> tuple[DictTensorDataset, DictTensorDataset]:
    """Token mappings whose ``labels`` (the input ids: the model shifts them) end in -100 padding."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (160, 12), generator=g)
    lengths = torch.randint(3, 13, (160, 1), generator=g)
    labels = ids.masked_fill(torch.arange(12) >= lengths, -100)
    return (DictTensorDataset(input_ids=ids[:128], labels=labels[:128]),
            DictTensorDataset(input_ids=ids[128:], labels=labels[128:]))


class AuxEveryOther(Mlp):
    """An auxiliary head used in every other training forward: its weights get no gradient on the others.
    It draws no random numbers."""

    def __init__(self, info: Any) -> None:
        super().__init__(info)
        self.aux = nn.Linear(16, info.num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        self.calls += 1
        out = self.head(h)
        return out + self.aux(h) if self.training and self.calls % 2 == 0 else out


def loss_with_mean_logit_penalty(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus a penalty on the batch's mean logit: a term of the whole batch, not a mean over
    its samples (no count divides anything)."""
    return F.cross_entropy(output, target) + 10.0 * output.mean().pow(2)

