"""``--model held_workers:held``: rank 0 of a process group, at its 2nd training forward, creates
the file named by ``HOLD_REACHED`` and waits there (for an interrupt); one process alone (the
reference run of ``scaleloop verify``) is never held. For the interrupt tests of
tests/distributed/test_loader_and_interrupts_dist.py.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_rank() == 0:
            self.calls += 1
            if self.calls == 2:
                Path(os.environ["HOLD_REACHED"]).touch()
                deadline = time.monotonic() + 300   # a bound for a test that failed without stopping it
                while time.monotonic() < deadline:
                    time.sleep(0.01)
        return self.net(x.flatten(1))


def held(info: Any = None) -> nn.Module:
    return _Held()
