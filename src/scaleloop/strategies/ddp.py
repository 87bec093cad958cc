"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaleloop.errors import UsageError
from scaleloop.runtime.dist import DistEnv, release_reducer
from scaleloop.strategies.base import HandWrittenLoop, ProcessGroupStrategy
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.parallelize import Parallelism
from scaleloop.strategies.syncbn import convert_batchnorm
from scaleloop.strategies.unused import names_of

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings


class DDP(HandWrittenLoop, ProcessGroupStrategy):
    """Each rank holds a full replica; DDP averages gradients over ranks as backward runs.

    DDP broadcasts rank 0's parameters and buffers when it wraps the model, so all replicas
    start equal, and keeps them equal because every rank applies the same averaged gradient.
    """

    name = "ddp"

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings", parallelism: Parallelism) -> "DDP":
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                   find_unused_parameters=settings.find_unused_parameters, static_graph=settings.static_graph)

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, find_unused_parameters: bool = False,
                 static_graph: bool = False, parallelism: Optional[Parallelism] = None) -> None:
        #: DDP's own options for models whose parameters do not all get a gradient every step.
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self._replica: Optional[DistributedDataParallel] = None
        self._steps = 0                        # optimizer steps this process has run (for messages)
        #: with accumulation: the parameters the current micro-step's backward reached (emptied as each begins)
        self._reached: Optional[set[int]] = None
        super().__init__(env, precision, accumulate, sync_batchnorm, parallelism=parallelism)

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        if not self.env.is_distributed:
            return model  # DDP over one process would only add overhead
        if self._sync_batchnorm:
            model = convert_batchnorm(model, self.env.device)
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        self._replica = DistributedDataParallel(model, device_ids=device_ids,
                                                find_unused_parameters=self.find_unused_parameters,
                                                static_graph=self.static_graph)
        if self.accumulate_steps > 1 and not (self.find_unused_parameters or self.static_graph):
            self._watch_last_backward(model)
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

    def sync_gradients(self) -> None:
        # After each step's last backward, before its optimizer step: DDP without its options
        # never all-reduces a bucket that holds a parameter with no gradient, so the step would
        # use unsynchronised gradients, the next forward fail ("Expected to have finished
        # reduction"), and a rank that used the parameter wait for that bucket while the others'
        # next collective pairs with it (Gloo aborts). So the check is this rank's alone, with no
        # collective: a rank that finds one stops with the names; torchrun then stops the others.
        if self._replica is None or self.find_unused_parameters or self.static_graph:
            return
        self._steps += 1
        missing = self._not_reached()
        if missing:
            # (The step counts this process's steps: after a resume, from the resumed one.)
            raise UsageError(f"parameter(s) {names_of(missing)} got no gradient on rank {self.env.rank} at step "
                             f"{self._steps}: add --find-unused-parameters (DDP cannot synchronise them; "
                             "--static-graph if the same ones are unused every step, or freeze them with "
                             "requires_grad=False)")

    def _not_reached(self) -> list[str]:
        """This rank's trainable parameters that the step's last backward did not reach."""
        assert self._replica is not None
        named = [(n, p) for n, p in self._replica.module.named_parameters() if p.requires_grad]
        if self._reached is None:
            # Without accumulation every gradient is None until the step's backward writes it.
            return [n for n, p in named if p.grad is None]
        # With accumulation an earlier micro-step's gradient is there, but DDP needs every
        # parameter in the last one's backward: hooks note which it reached.
        missing = [n for n, p in named if id(p) not in self._reached]
        self._reached.clear()
        return missing

    def _watch_last_backward(self, model: nn.Module) -> None:
        """With accumulation, note the parameters each step's last backward reaches (``accumulate``)."""
        self._reached = set()
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._note_reached)

    def _note_reached(self, param: torch.Tensor) -> None:
        if self._reached is not None:
            self._reached.add(id(param))

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        # On micro-steps before the last, no_sync keeps gradients local: no all-reduce until
        # the final micro-step, whose backward then reduces the accumulated sum once.
        if last or not isinstance(model, DistributedDataParallel):
            if self._reached is not None:
                self._reached.clear()
            yield
        else:
            with model.no_sync():
                yield
