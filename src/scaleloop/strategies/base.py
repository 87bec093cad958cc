"""The small interface every strategy implements, with the single-process behaviour as default.

A strategy owns what changes between "one process" and "many": how the model is wrapped,
which samples this rank loads, how gradients are synchronised, and how numbers reported by
rank 0 are reduced over all ranks. The training loop only talks to this interface.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import Dataset

from scaleloop.data.batching import check_batch_split
from scaleloop.data.loader import Batch, ShardedLoader
from scaleloop.data.sampler import StepPlan
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.precision import Precision

OptimizerLike = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]
_NOTHING = contextlib.nullcontext()   # reusable: it holds no state


class Strategy:
    """Single-process defaults; subclasses override what their parallelism changes."""

    name = "base"
    #: Each rank holds only part of the model and optimizer state, so every rank writes its part
    #: of a checkpoint (``save_sharded``) instead of rank 0 writing it all (``checkpoint_state``).
    sharded_checkpoint = False
    #: Each forward pass is a collective (FSDP all-gathers parameters in it): every rank must run
    #: the same number of them, also when evaluating a test set that splits unevenly.
    collective_forward = False

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False) -> None:
        self.env = env
        self.precision = precision or Precision("fp32", env.device)
        self.accumulate_steps = accumulate
        self.sync_batchnorm = sync_batchnorm
        self.check()

    def check(self) -> None:
        """Raise UsageError if this strategy cannot run in ``env`` (and say what to do instead)."""

    # --- set-up -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move/wrap the model; ``optimizer`` is an optimizer or a ``params -> optimizer`` factory."""
        model = self.wrap(model.to(self.env.device))
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model.parameters())
        return model, optimizer

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the (already moved) model for this strategy."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper ``setup`` added (DDP, DataParallel), and
        inside ``torch.compile``'s wrapper if the user compiled it: a state_dict of the result
        has the user's own keys (no ``module.`` or ``_orig_mod.`` prefix)."""
        model = _uncompiled(model)
        return _uncompiled(getattr(model, "module", model))

    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = False, num_workers: int = 0) -> ShardedLoader:
        """Batches for this rank; ``batch_size`` is the GLOBAL batch of one optimizer step."""
        check_batch_split(batch_size, self.env.world_size, self.accumulate_steps)
        plan = StepPlan(len(dataset), batch_size, world_size=self.env.world_size, rank=self.env.rank,
                        accumulate=self.accumulate_steps, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return ShardedLoader(dataset, plan, self.env.device, num_workers=num_workers,
                             pin_memory=self.env.device.type == "cuda")

    # --- one step -----------------------------------------------------------------------
    def accumulate(self, model: nn.Module, batch: Union[Batch, int]) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward (strategies skip sync inside it)."""
        return _NOTHING  # (not a generator: entered on every micro-step)

    def is_sync_step(self, batch: Union[Batch, int]) -> bool:
        """True on the micro-step after which gradients are synchronised and the optimizer steps."""
        if isinstance(batch, Batch):
            return batch.last_micro
        return (batch + 1) % self.accumulate_steps == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def forward_backward(self, model: nn.Module, batch: Batch,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
        """Forward and backward of one micro-batch, gradient synchronisation skipped on all but
        the step's last micro-batch.

        ``loss_fn(output, target)`` is the mean loss over the samples it is given. Returns that
        loss for the whole micro-batch, detached, or None on a rank that does not compute it
        (a pipeline's earlier stages).
        """
        x, y = batch
        with self.accumulate(model, batch):
            with self.autocast():
                loss = loss_fn(model(x), y)
            self.backward(loss, batch)
        return loss.detach()

    def backward(self, loss: torch.Tensor, batch: Optional[Batch] = None) -> None:
        """Backward on the loss weighted for accumulation (and fp16 loss scaling).

        With a ``Batch`` the weight is its exact share of the global step; without one, the
        micro-batches are assumed equal (weight ``1 / accumulate``).
        """
        scale = batch.loss_scale if batch is not None else 1.0 / self.accumulate_steps
        # A weight of exactly 1 (one process, no accumulation) is skipped: x * 1.0 is x, bit
        # for bit, forward and backward, and the multiplication would be one more op per step.
        self.precision.scale(loss * scale if scale != 1.0 else loss).backward()
        if batch is None or batch.last_micro:
            self.after_backward()

    def after_backward(self) -> None:
        """Hook after the last micro-step's backward (manual gradient synchronisation goes here)."""

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Unscale (fp16) and clip the global gradient norm; returns the norm before clipping."""
        self.precision.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (skipped by the fp16 scaler on overflow) and zero the gradients. True if stepped."""
        stepped = self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return stepped

    # --- evaluation ---------------------------------------------------------------------
    def eval_indices(self, n: int) -> range:
        """The block of an ``n``-sample evaluation set this rank evaluates (each sample once over
        all ranks; a pipeline's stages all walk every sample)."""
        from scaleloop.runtime.collectives import shard_indices

        return shard_indices(n, self.env)

    def eval_forward(self, model: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The model's output for ``x`` in evaluation (under ``torch.no_grad``), or None on a rank
        that does not produce outputs (a pipeline's earlier stages)."""
        with self.autocast():
            return model(x)

    # --- numbers rank 0 reports ---------------------------------------------------------
    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over all ranks (every rank must call it)."""
        return values

    def barrier(self) -> None:
        """Wait for every rank."""

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (every rank must call it)."""
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (every rank must call it; others pass anything)."""
        return obj

    # --- checkpoints --------------------------------------------------------------------
    @property
    def writes_checkpoint(self) -> bool:
        """Whether this rank writes the checkpoint file: with replicas, rank 0 holds everything."""
        return self.env.is_main

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full model (unwrapped, so it loads into a plain module) and optimizer state."""
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def expected_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint's ``model`` entry must hold: keys and shapes of the user's whole module."""
        return self.unwrap(model).state_dict()

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
        """Load what :meth:`checkpoint_state` saved (on every rank: replicas start equal)."""
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Every rank writes its part of the model and optimizer state into ``directory``
        (``torch.distributed.checkpoint``; a collective)."""
        from scaleloop.strategies import distcp

        distcp.save_state(self.unwrap(model), optimizer, directory)

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Load a checkpoint that :meth:`save_sharded` wrote, with any world size (a collective).

        Any strategy can: a replicated one reads the whole state on every rank.
        """
        from scaleloop.strategies import distcp

        distcp.load_state(self.unwrap(model), optimizer, directory)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The user's module's full ``state_dict`` on rank 0, on the CPU or not (every rank must
        call it: for a sharded strategy it is a collective; other ranks may get an empty dict)."""
        return self.unwrap(model).state_dict()

    def sync_buffers(self, model: nn.Module) -> None:
        """Make every rank's buffers (BatchNorm statistics) rank 0's, where the strategy does not
        already (a collective). Called before evaluating, checkpointing and exporting."""

    def close(self) -> None:
        """Release what the strategy itself set up (the end of ``train``)."""

    def describe(self) -> str:
        return self.name

    def details(self) -> list[str]:
        """Lines a run prints after its header (how the strategy placed the model, notes)."""
        return []


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (its ``OptimizedModule`` keeps it as
    ``_orig_mod``); any other module as it is. (``module.compile()`` compiles in place and
    needs no unwrapping.)"""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


class ProcessGroupStrategy(Strategy):
    """A strategy with one process per device in a ``torch.distributed`` process group."""

    def check(self) -> None:
        if self.env.is_distributed and not torch_dist.is_initialized():
            raise RuntimeError(f"{self.name}: call scaleloop.init_process_group(env) before building the strategy")

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.env.is_distributed:
            torch_dist.all_reduce(values, op=torch_dist.ReduceOp.SUM)
        return values

    def barrier(self) -> None:
        if self.env.is_distributed:
            torch_dist.barrier()

    def gather_object(self, obj: Any) -> list[Any]:
        if not self.env.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.env.world_size
        torch_dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.env.is_distributed:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]
