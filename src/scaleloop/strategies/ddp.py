"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Union

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaleloop.data.loader import Batch
from scaleloop.errors import UsageError
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.dist import DistEnv, release_reducer
from scaleloop.strategies.base import HandWrittenLoop, ProcessGroupStrategy
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.syncbn import convert_batchnorm

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings


class DDP(HandWrittenLoop, ProcessGroupStrategy):
    """Each rank holds a full replica; DDP averages gradients over ranks as backward runs.

    DDP broadcasts rank 0's parameters and buffers when it wraps the model, so all replicas
    start equal, and keeps them equal because every rank applies the same averaged gradient.
    """

    name = "ddp"

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings") -> "DDP":
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm,
                   find_unused_parameters=settings.find_unused_parameters, static_graph=settings.static_graph)

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, find_unused_parameters: bool = False,
                 static_graph: bool = False) -> None:
        #: DDP's own options for models whose parameters do not all get a gradient every step.
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self._replica: Optional[DistributedDataParallel] = None
        self._checked_gradients = False
        super().__init__(env, precision, accumulate, sync_batchnorm)

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.env.is_distributed:
            return model  # DDP over one process would only add overhead
        if self._sync_batchnorm:
            model = convert_batchnorm(model, self.env.device)
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        self._replica = DistributedDataParallel(model, device_ids=device_ids,
                                                find_unused_parameters=self.find_unused_parameters,
                                                static_graph=self.static_graph)
        return self._replica

    def close(self) -> None:
        """Release the wrapper's Reducer (``runtime.dist.release_reducer``): the end of training.
        ``.module`` stays usable; the wrapper no longer synchronises."""
        replica, self._replica = self._replica, None
        if replica is not None:
            release_reducer(replica)

    def describe(self) -> str:
        options = [o for o, on in (("find unused parameters", self.find_unused_parameters),
                                   ("static graph", self.static_graph)) if on]
        return self.name + (f" ({', '.join(options)})" if options else "")

    def _sync_gradients(self) -> None:
        # After the first step's backward, before its optimizer step: DDP without its options
        # never all-reduces a bucket that holds a parameter with no gradient, so the step would
        # silently use unsynchronised gradients (and the next forward fail). Checked once.
        if self._checked_gradients or self._replica is None:
            return
        self._checked_gradients = True
        if self.find_unused_parameters or self.static_graph:
            return
        mine = [name for name, p in self._replica.module.named_parameters() if p.requires_grad and p.grad is None]
        unused = sorted({name for names in gather_object(mine, self.env) for name in names})
        if unused:
            shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
            raise UsageError(f"{len(unused)} parameter(s) got no gradient in the first step ({shown}), which DDP "
                             "cannot synchronise: add --find-unused-parameters, or --static-graph if the same "
                             "ones are unused every step (or give them requires_grad=False)")

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, batch: Union[Batch, int]) -> Iterator[None]:
        # On micro-steps before the last, no_sync keeps gradients local: no all-reduce until
        # the final micro-step, whose backward then reduces the accumulated sum once.
        if self.is_sync_step(batch) or not isinstance(model, DistributedDataParallel):
            yield
        else:
            with model.no_sync():
                yield
