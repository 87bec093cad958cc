"""``nn.DataParallel``: one process scatters each batch over all visible GPUs.

The model is replicated to every GPU on every forward, inputs are split along the batch,
outputs gathered on GPU 0 and gradients summed back there. It is the tutorial's first step;
DDP (one process per GPU) is faster and is what PyTorch recommends.
"""
from __future__ import annotations

import torch
from torch import nn

from scaleloop.errors import UsageError
from scaleloop.strategies.base import HandWrittenLoop


class DataParallel(HandWrittenLoop):
    """Single process, all visible CUDA GPUs."""

    name = "dp"

    def _check(self) -> None:
        if self.env.device.type != "cuda":
            raise UsageError(
                "--strategy dp needs CUDA GPUs (nn.DataParallel splits each batch over the GPUs of "
                f"one process) and this run is on {self.env.device.type}; use --strategy single, or "
                "--strategy ddp --nproc N for N processes on the CPU")

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        if self._sync_batchnorm:
            raise UsageError("--sync-batchnorm needs one process per device; use --strategy ddp with it")
        # From this run's device on: the module and its outputs live there (cuda:N, N > 0, too).
        return nn.DataParallel(model, device_ids=self._device_ids(), output_device=self.env.device)

    def _device_ids(self) -> list[int]:
        first = self.env.device.index or 0
        return list(range(first, torch.cuda.device_count()))

    def describe(self) -> str:
        return f"dp ({len(self._device_ids())} GPUs)"
