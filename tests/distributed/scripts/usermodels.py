"""Models and data as users write them, for ``--model/--data usermodels:NAME`` in the tests.

- ``Unused``: a layer that never gets a gradient; ``Frozen``/``FrozenSeq``: a frozen first layer;
- conditional computation: ``AuxHead``/``AuxHeadSeq``, an auxiliary head used on every third
  training step only (no rank uses it on the others); ``RareExpert``/``RareExpertSeq``, an expert
  that only the few samples with pixel 15 lit are routed to (used on no rank, one or both), inside
  a layer that always runs; ``RareExpertTop``, the same expert called only when routed to, as a
  top-level module (FSDP's unit of its own), and ``RareExpertFirst``, the routed layer first, so
  that its output carries a gradient only where the expert ran;
- ``Keywords`` on ``keyword_data`` (in memory) or ``keyword_items`` (a map-style dataset of
  dicts, read through the DataLoader): keyword inputs and ``labels``, returning an object with
  ``logits`` and its own ``loss`` like a Hugging Face model;
- ``TwoInputs`` on ``two_input_data``: ``model(a, b)`` from samples ``(a, b, y)``;
- ``Regressor`` on ``regression_data``: float targets of 3 values (mean squared error);
- ``padded_tokens``: language-model pairs ``(tokens, next tokens)`` whose targets end in -100
  padding (for ``tinygpt``, with scaleloop's loss).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from scaleloop import DictTensorDataset


class Unused(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.spare = nn.Linear(64, 10)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class Frozen(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)
        self.body.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x.flatten(1))))


def FrozenSeq(info: Any = None) -> nn.Sequential:
    """Frozen first layer in a model the pipeline strategy can cut into stages."""
    model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    model[1].requires_grad_(False)
    return model


class _EveryThird(nn.Module):
    """Adds ``aux(h)`` on every third training forward (a buffer counts them, so that the pipeline's
    shape probe, whose buffer changes are undone, does not count)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.aux = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        self.calls += 1
        return h + self.aux(h) if int(self.calls) % 3 == 0 else h


class AuxHead(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.trunk = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)
        self.aux = _EveryThird(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.aux(torch.relu(self.trunk(x.flatten(1)))))


def AuxHeadSeq(info: Any = None) -> nn.Sequential:
    """``AuxHead`` as layers the pipeline cuts into stages."""
    return nn.Sequential(nn.Flatten(1), nn.Linear(64, 32), nn.ReLU(), _EveryThird(32), nn.Linear(32, 10))


def _routed(x: torch.Tensor) -> torch.Tensor:
    """The samples routed to the expert: pixel 15 lit (about 3 in 100 of the digits)."""
    return (x[:, 15] > 0).nonzero().squeeze(1)


class Routed(nn.Module):
    """A layer holding an expert that only the routed samples go through (by default those whose
    input is routed; the expert is skipped when none is): the layer always runs, its expert not."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.expert = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = _routed(h) if rows is None else rows
        if rows.numel() == 0:
            return h
        return h.index_add(0, rows, torch.tanh(self.expert(h[rows])))


class RareExpert(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.moe = Routed(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.head(self.moe(torch.relu(self.body(x)), _routed(x)))


def RareExpertSeq(info: Any = None) -> nn.Sequential:
    """A rare expert in layers the pipeline cuts into stages (the routed layer, first, is stage 0)."""
    return nn.Sequential(nn.Flatten(1), Routed(64), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class RareExpertTop(nn.Module):
    """The expert as a top-level module, called only when a sample is routed to it."""

    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.expert = nn.Linear(64, 64)
        self.body = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        rows = _routed(x)
        if rows.numel():
            x = x.index_add(0, rows, torch.tanh(self.expert(x[rows])))
        return self.head(torch.relu(self.body(x)))


class RareExpertFirst(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.moe = Routed(64)
        self.body = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.moe(x.flatten(1)))))


class Output:
    """Like a Hugging Face ``ModelOutput``: attributes ``loss`` (given labels) and ``logits``."""

    def __init__(self, logits: torch.Tensor, loss: Optional[torch.Tensor]) -> None:
        self.logits, self.loss = logits, loss


class Keywords(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> Output:
        mask = attention_mask.unsqueeze(-1).float()
        logits = self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))
        return Output(logits, nn.functional.cross_entropy(logits, labels) if labels is not None else None)


def _keyword_tensors(n: int = 200) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (n, 12), generator=g)
    mask = (torch.arange(12) < torch.randint(4, 13, (n, 1), generator=g)).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids[:, 0] % 3}


def keyword_data() -> tuple[Dataset, Dataset]:
    t = _keyword_tensors()
    return (DictTensorDataset({k: v[:160] for k, v in t.items()}),
            DictTensorDataset({k: v[160:] for k, v in t.items()}))


class _Items(Dataset):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


def keyword_items() -> tuple[Dataset, Dataset]:
    t = _keyword_tensors()
    return _Items({k: v[:160] for k, v in t.items()}), _Items({k: v[160:] for k, v in t.items()})


class TwoInputs(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(a) + self.b(b))
        return self.head(h), h  # (prediction, extra): the first element is the prediction


def two_input_data() -> tuple[Dataset, Dataset]:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(300, 5, generator=g), torch.randn(300, 3, generator=g)
    y = (a[:, 0] > 0).long() * 2 + (b[:, 0] > 0).long()
    return TensorDataset(a[:240], b[:240], y[:240]), TensorDataset(a[240:], b[240:], y[240:])


class Regressor(nn.Module):
    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.net(x)}


def regression_data() -> tuple[Dataset, Dataset]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 6, generator=g)
    y = torch.stack([x[:, 0] + x[:, 1], x[:, 2] * 0.5, -x[:, 3]], dim=1)
    return TensorDataset(x[:240], y[:240]), TensorDataset(x[240:], y[240:])


def abs_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user metric: one value per sample."""
    return (prediction - target).abs().flatten(1).mean(1)


def huber(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user loss: the mean over the batch."""
    return nn.functional.smooth_l1_loss(prediction, target)


class Chatty(nn.Module):
    """Returns something no rule reads."""

    def __init__(self, info: Any = None) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> str:
        return "a string"


def padded_tokens() -> tuple[Dataset, Dataset]:
    """``(x, y)`` pairs of 16 tokens of a vocabulary of 64, ``y`` the next tokens, -100 from a
    random length on: the samples, and so the micro-batches, hold different counts of real targets."""
    g = torch.Generator().manual_seed(11)
    stream = torch.randint(0, 64, (200, 17), generator=g)
    stream[:, 1::2] = (stream[:, 0:-1:2] + 1) % 64   # every other token follows from the one before
    lengths = torch.randint(4, 17, (200, 1), generator=g)
    y = stream[:, 1:].masked_fill(torch.arange(16) >= lengths, -100)
    x = stream[:, :-1].contiguous()
    return TensorDataset(x[:160], y[:160]), TensorDataset(x[160:], y[160:])
