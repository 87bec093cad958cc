"""Shared fixtures for the checkpoint tests."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Train with one intra-op thread: these runs are tiny, and with other processes on the CPU
    several threads spin against each other (a 4x slowdown was measured on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
