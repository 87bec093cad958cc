"""Datasets whose reading fails in a DataLoader worker process, for --data loader_faults:NAME
(tests/distributed/test_loader_and_interrupts_dist.py): sample 77 raises, or kills its worker."""
from __future__ import annotations

import os
import signal

import torch
from torch.utils.data import Dataset, get_worker_info

BAD_SAMPLE = 77


class _Samples(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == BAD_SAMPLE:
            self.fail(i)
        g = torch.Generator().manual_seed(i)
        return torch.randn(20, generator=g), torch.tensor(float(i % 2))

    def fail(self, i: int) -> None:
        raise NotImplementedError


class Raises(_Samples):
    def fail(self, i: int) -> None:
        raise ValueError(f"cannot decode record {i}")


class Killed(_Samples):
    def fail(self, i: int) -> None:
        if get_worker_info() is not None:   # only a worker process, as the out-of-memory killer picks it
            os.kill(os.getpid(), signal.SIGKILL)


def raises(cfg: object) -> tuple[Dataset, Dataset]:
    return Raises(), Raises()


def killed(cfg: object) -> tuple[Dataset, Dataset]:
    return Killed(), Killed()
