"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""
from __future__ import annotations

import contextlib
from typing import Iterator, Union

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaleloop.data.loader import Batch
from scaleloop.strategies.base import HandWrittenLoop, ProcessGroupStrategy
from scaleloop.strategies.syncbn import convert_batchnorm


class DDP(HandWrittenLoop, ProcessGroupStrategy):
    """Each rank holds a full replica; DDP averages gradients over ranks as backward runs.

    DDP broadcasts rank 0's parameters and buffers when it wraps the model, so all replicas
    start equal, and keeps them equal because every rank applies the same averaged gradient.
    """

    name = "ddp"

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.env.is_distributed:
            return model  # DDP over one process would only add overhead
        if self._sync_batchnorm:
            model = convert_batchnorm(model, self.env.device)
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, batch: Union[Batch, int]) -> Iterator[None]:
        # On micro-steps before the last, no_sync keeps gradients local: no all-reduce until
        # the final micro-step, whose backward then reduces the accumulated sum once.
        if self.is_sync_step(batch) or not isinstance(model, DistributedDataParallel):
            yield
        else:
            with model.no_sync():
                yield
