"""User models that are slow on purpose, for the straggler report and the read-only run directory.

``--model slow_models:rank1``: rank 1 sleeps 30 ms in every training forward (a straggler);
``--model slow_models:everyone``: every rank sleeps 30 ms per training forward (a slow, healthy run).
``--model slow_models:held``: rank 0, at its 8th training forward, creates the file named by
``HOLD_REACHED`` and waits there until the file named by ``HOLD_RELEASE`` exists (a run held at a
known point, for a test to look at while it lives).
The rank is read as a user would, from torch.distributed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SLEEP_S = 0.03


class _Slow(nn.Module):
    def __init__(self, only_rank: int | None) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.only_rank = only_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.training and (self.only_rank is None or rank == self.only_rank):
            time.sleep(SLEEP_S)
        return self.net(x.flatten(1))


def rank1(info: Any = None) -> nn.Module:
    return _Slow(1)


def everyone(info: Any = None) -> nn.Module:
    return _Slow(None)


HELD_AT = 8


class _Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and (not dist.is_initialized() or dist.get_rank() == 0):
            self.calls += 1
            if self.calls == HELD_AT:
                Path(os.environ["HOLD_REACHED"]).touch()
                while not Path(os.environ["HOLD_RELEASE"]).exists():
                    time.sleep(0.01)
        return self.net(x.flatten(1))


def held(info: Any = None) -> nn.Module:
    return _Held()
