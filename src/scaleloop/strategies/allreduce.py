"""Data parallelism written out by hand: what DDP does, in a few lines you can read.

1. Every rank starts from rank 0's weights (a broadcast).
2. Every rank runs forward and backward on its own shard of the global batch.
3. After the last micro-step's backward, every gradient is summed over ranks with
   ``all_reduce`` and divided by the number of ranks: each rank now holds the gradient of the
   whole global batch, so the identical optimizer step keeps the replicas identical.

A parameter that some rank did not use this step (conditional computation) takes part with a
zero gradient from that rank; one that no rank used keeps no gradient at all, as in one process,
so the optimizer leaves it and its state alone (``strategies.unused``: one small all-reduce of
which parameters got a gradient, before the gradients').

DDP does the same, but in buckets that are reduced while backward is still running.
"""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.strategies.base import HandWrittenLoop, ProcessGroupStrategy
from scaleloop.strategies.syncbn import convert_batchnorm
from scaleloop.strategies.unused import used_anywhere


class ManualAllReduce(HandWrittenLoop, ProcessGroupStrategy):
    """A plain model plus an explicit gradient all-reduce after backward."""

    name = "allreduce"

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        self._model = model
        if not self.env.is_distributed:
            return model
        if self._sync_batchnorm:
            model = convert_batchnorm(model, self.env.device)
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                torch_dist.broadcast(tensor, src=0)
        self._model = model
        return model

    def sync_gradients(self) -> None:
        # (bench's CommRecorder times this call: bench/worker.py wraps it per instance)
        world = self.env.world_size
        if world == 1:
            return
        params = list(self._model.parameters())
        # Every rank learns which parameters got a gradient on some rank, so that all of them
        # all-reduce the same ones (the collectives of different ranks must line up).
        used = used_anywhere([p.grad is not None for p in params], self.env.device)
        for param, anywhere in zip(params, used):
            if not anywhere:
                continue   # no gradient in one process either: the optimizer skips it
            if param.grad is None:
                # Unused on this rank only: its share of the global batch contributes zero.
                param.grad = torch.zeros_like(param)
            torch_dist.all_reduce(param.grad, op=torch_dist.ReduceOp.SUM)
            param.grad.div_(world)
