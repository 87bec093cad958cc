"""The training step, written once: ``train``, ``verify`` and ``bench`` all call :func:`train_step`.

One optimizer step is one or more micro-batches, then one update::

    for micro_batches in steps_of(run.loader):
        losses, grad_norm = train_step(run, micro_batches, watch)

Each micro-batch is a forward, its loss and a backward weighted by the micro-batch's share of the
global step; the strategy skips gradient synchronisation on all but the last. (A pipeline runs
forward and backward as one call of its schedule: the one branch.) Then, once: unscale (fp16), the
gradient norm, clip, the optimizer step, ``zero_grad``, the schedule's step. What differs between
one process and many is the strategy's few hooks (``no_sync``, ``autocast``, ``sync_gradients``,
``grad_norm``; ``scaleloop.strategies``); the step itself is the same for all.

Between replica groups (``--replica-groups``, ``strategies.fault_tolerant``) the optimizer steps
only on a committed step (``commit``): a step during which a group failed is not committed, its
gradients are dropped, and the groups still present take the same micro-batches again (the step
calls itself), so that no step is lost; the optimizer and the schedule step once, on the committed one.

Whoever watches a step (the trainer's clock, ``verify``'s recorder, ``bench``'s timers) passes an
:class:`Observer`; its methods are called at fixed points of the step and change nothing in it.

Over -100 padding (``Run.count``, ``loop.losses``) each micro-batch's real targets are counted
too, and once per step, after the last backward and before clipping, the count is summed over
the ranks and the gradients and the step's losses are weighted by it, so that the step is the
mean over its real targets. That is why the losses are handed back only after the update.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from scaleloop.data.batch import call_model
from scaleloop.data.loader import Batch
from scaleloop.loop.build import Run
from scaleloop.loop.losses import LossFn
from scaleloop.strategies.base import clip_gradients, weighted


class Observer:
    """Watches a :func:`train_step`; each method is called at its point in the step and does
    nothing unless a subclass overrides it. (A step that replica groups take again calls all but
    :meth:`stepped` again.)"""

    def micro_batch(self, batch: Batch) -> None:
        """Before a micro-batch's forward pass (the batch as loaded)."""

    def forward_done(self, loss: torch.Tensor) -> None:
        """After a micro-batch's loss is computed, before its backward (per pipeline piece under
        the pipeline strategy, which interleaves the two)."""

    def micro_done(self, batch: Batch, loss: Optional[torch.Tensor]) -> None:
        """After a micro-batch's backward; ``loss`` is None on a rank that computes none."""

    def counted(self, factor: float) -> None:
        """Over -100 padding, before :meth:`synced`: the synchronised gradients were multiplied by
        ``factor`` to weigh the step's real targets (1.0: they were not)."""

    def synced(self) -> None:
        """After the step's last backward: gradients are synchronised, not yet clipped."""

    def stepped(self) -> None:
        """After the optimizer and the schedule have stepped."""


def train_step(run: Run, micro_batches: list[Batch], watch: Observer,
               norm: bool = False) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
    """One optimizer step of ``run`` over ``micro_batches`` (the step's, in order); ``norm``: take
    the gradient norm even without clipping (a log row's). The learning rate the step used is the
    optimizer's before the call.

    Returns each micro-batch's mean loss, detached (None on a rank that computes no loss: a
    pipeline's earlier stages), and the whole gradient's 2-norm before clipping (unscaled under
    fp16), on the device; None when neither clipping nor ``norm`` asked for it.
    """
    model, strategy, optimizer, count = run.model, run.strategy, run.optimizer, run.count
    precision, clip = strategy.precision, run.cfg.optim.clip_grad
    loss_fn = _watched(count.checked(run.loss_fn) if count is not None else run.loss_fn, watch)
    losses: list[Optional[torch.Tensor]] = []
    strategy.begin_step(micro_batches[0])   # replica groups meet here (strategies.fault_tolerant)
    for batch in micro_batches:
        watch.micro_batch(batch)
        # Over -100 padding the batch's real targets are counted (a Hugging Face model is told the
        # divisor in its inputs), and its loss kept to be weighted by the whole step's count.
        fed = count.batch(batch) if count is not None else batch
        if strategy.pipelined:   # forward and backward are one call of the pipeline's schedule
            loss = strategy.forward_backward(model, fed, loss_fn)
        else:
            x, y = fed
            # Gradients stay local on all but the step's last micro-batch (DDP's no_sync, FSDP's
            # deferred reduce-scatter); its backward synchronises them.
            with strategy.no_sync(model, last=batch.last_micro):
                with strategy.autocast():
                    loss = loss_fn(call_model(model, x), y)
                # Weighted by the micro-batch's share of the global step; scaled under fp16.
                precision.scale(weighted(loss, batch.loss_scale)).backward()
            if batch.last_micro:
                strategy.sync_gradients()   # what the wrapper does not (allreduce's all-reduce)
            loss = loss.detach()
        if count is not None:
            loss = count.keep(loss)
        watch.micro_done(batch, loss)
        losses.append(loss)
    if count is not None:
        # A collective: every rank learns the step's count (and whether the model took it) at once.
        watch.counted(count.finish(model))
    watch.synced()
    precision.unscale_(optimizer)   # fp16: the gradients' true size, before the norm and the step
    grad_norm = strategy.grad_norm(model) if clip is not None or norm else None
    if clip is not None:
        clip_gradients(model, grad_norm, clip)
    if not strategy.commit():   # always committed, but not between replica groups if a group failed in it:
        optimizer.zero_grad(set_to_none=True)   # its gradients are dropped, and the groups present
        return train_step(run, micro_batches, watch, norm)   # take the same step again
    precision.step(optimizer)   # fp16: skipped when the gradients overflowed
    optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    watch.stepped()
    return losses, grad_norm


def steps_of(batches: Iterable[Batch]) -> Iterator[list[Batch]]:
    """The loader's micro-batches, grouped into optimizer steps (a step ends at ``last_micro``)."""
    step: list[Batch] = []
    for batch in batches:
        step.append(batch)
        if batch.last_micro:
            yield step
            step = []


def _watched(loss_fn: LossFn, watch: Observer) -> LossFn:
    """``loss_fn``, telling ``watch`` when each loss is known (the end of a forward)."""
    def loss_and_tell(output: Any, target: Any) -> torch.Tensor:
        loss = loss_fn(output, target)
        watch.forward_done(loss)
        return loss
    return loss_and_tell
