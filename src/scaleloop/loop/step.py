"""The training step, written once: ``train``, ``verify`` and ``bench`` all run this code.

A step is one or more micro-batches (``Step.micro``: forward, loss, backward weighted by the
micro-batch's share of the global step; the strategy skips gradient synchronisation on all
but the last) and one update (``Step.update``: clip, optimizer step, schedule step). The
caller keeps the loop over the loader, so that a reader sees where a step starts and ends::

    for batch in run.loader:
        loss = step.micro(batch)
        if batch.last_micro:
            lr = step.update()

``verify``'s recorder and ``bench``'s timers watch a step through an :class:`Observer`; with
none (``scaleloop train``), the step costs nothing beyond the strategy's own calls and, with
more than one rank, one clock reading per micro-batch: :attr:`Step.own_s` adds up the time this
rank spends on its own work (data, forward passes) before its last loss of a step is known, the
part of a step that does not wait for the other ranks, so that the log rows can compare ranks (a
straggler). One rank has no one to compare with: its clock is not read.

A step of a small model takes well under a millisecond on a CPU, so what :class:`Step` does
around the strategy's calls is decided once, when it is built: with no observer, one rank and
a strategy whose step is the plain hand-written one (``Strategy.plain_step``: fp32, no context
or hook around the calls), :meth:`Step.micro` and :meth:`Step.update` are replaced by the same
calls written out, with nothing per step that would do nothing.

Over -100 padding (``Run.counting``, ``loop.padding``) each micro-batch's real targets are
counted too, and once per step, after the last backward and before clipping, the count is summed
over the ranks and the gradients are weighted by it, so that a step is the mean over the step's
real targets. A micro-batch's returned loss is then final only after that step's :meth:`Step.update`
(multiplied in place by the same weight): whoever keeps it reads it after the update.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from scaleloop.data.batch import call_model
from scaleloop.data.loader import Batch
from scaleloop.loop.build import Run
from scaleloop.loop.padding import StepCount
from scaleloop.output.memory import gradient_bytes


class Observer:
    """Hooks into a :class:`Step`, in the order they run; each does nothing unless overridden."""

    def micro_batch(self, batch: Batch) -> None:
        """Before a micro-batch's forward pass."""

    def forward_done(self, loss: torch.Tensor) -> None:
        """After a micro-batch's loss is computed, before its backward (per pipeline piece
        under the pipeline strategy, which interleaves the two)."""

    def micro_done(self, batch: Batch, loss: Optional[torch.Tensor]) -> None:
        """After a micro-batch's backward; ``loss`` is None on a rank that computes none."""

    def synced(self) -> None:
        """After the step's last backward: gradients are synchronised, not yet clipped."""

    def stepped(self) -> None:
        """After the optimizer and the schedule have stepped."""

    def counted(self, factor: float) -> None:
        """Over -100 padding (``loop.padding``), before :meth:`synced`: the synchronised gradients were
        multiplied by ``factor`` to weigh the step's real targets (1.0: they were not)."""


class Step:
    """One optimizer step of a built :class:`Run`, micro-batch by micro-batch."""

    def __init__(self, run: Run, observer: Optional[Observer] = None) -> None:
        self.model = run.model
        self.optimizer = run.optimizer
        self.scheduler = run.scheduler
        self.strategy = run.strategy
        self.clip = run.cfg.clip_grad
        self.observer = observer
        #: Over -100 padding: this step's count of real targets (None: the run does not count).
        self.count = (StepCount(run.counting, run.env, run.strategy.layout.data_parallel)
                      if run.counting is not None else None)
        self._loss_fn = run.loss_fn if self.count is None else self.count.checked(run.loss_fn)
        #: Whether this rank's own seconds are measured: only where there are ranks to compare.
        self.clocked = run.env.world_size > 1
        if observer is not None:
            self.loss_fn = self._observed_loss
        else:
            self.loss_fn = self._timed_loss if self.clocked else self._loss_fn
        #: The gradients' bytes at the first update (they exist only between backward and step).
        self.gradient_bytes: Optional[int] = None
        self._measured = False
        #: Seconds of this rank's own work (see the module doc) since the last :meth:`take_own_s`
        #: (stays 0 on one rank: see ``clocked``).
        self.own_s = 0.0
        self._step_began = self._loss_known = time.perf_counter()
        if self.count is not None:
            self.micro = self._counted_micro  # type: ignore[method-assign]
        elif observer is None and not self.clocked and self.strategy.plain_step():
            # The common case (one process, fp32): the same calls without the layers around them.
            self.micro = self._plain_micro    # type: ignore[method-assign]
            self.update = self._plain_update  # type: ignore[method-assign]

    def _timed_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(output, target)
        self._loss_known = time.perf_counter()   # host time: the rank's own work up to here
        return loss

    def _observed_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._timed_loss(output, target)
        self.observer.forward_done(loss)  # type: ignore[union-attr]
        return loss

    def restart_clock(self) -> None:
        """The next step's own time starts now (after a pause: evaluation, a checkpoint, an epoch's start)."""
        if self.clocked:
            self._step_began = self._loss_known = time.perf_counter()

    @property
    def last_progress(self) -> float:
        """``time.perf_counter()`` when the loop last moved on: the last step's end, or a restart of the
        clock (kept with several ranks only, see ``clocked``: one rank has nobody to recover with)."""
        return self._step_began

    def take_own_s(self) -> float:
        """This rank's own seconds since the last call (then counted from zero again)."""
        own, self.own_s = self.own_s, 0.0
        return own

    def micro(self, batch: Batch) -> Optional[torch.Tensor]:
        """Forward and backward of one micro-batch; its mean loss, detached (None on a rank
        that computes no loss: a pipeline's earlier stages)."""
        observer = self.observer
        if observer is not None:
            observer.micro_batch(batch)
        loss = self.strategy.forward_backward(self.model, batch, self.loss_fn)
        if observer is not None:
            observer.micro_done(batch, loss)
        return loss

    def _counted_micro(self, batch: Batch) -> Optional[torch.Tensor]:
        """:meth:`micro` over -100 padding: the batch's real targets counted (a Hugging Face model told
        its divisor), and its loss kept to be weighted by the step's count in :meth:`update`."""
        count = self.count
        if count is None:   # the model turned out not to take the count: as without padding
            return Step.micro(self, batch)
        observer = self.observer
        if observer is not None:
            observer.micro_batch(batch)   # the batch as loaded (verify hashes it)
        loss = count.keep(self.strategy.forward_backward(self.model, count.batch(batch), self.loss_fn))
        if observer is not None:
            observer.micro_done(batch, loss)
        return loss

    def update(self) -> float:
        """Clip, step the optimizer (fp16: skipped on overflow) and the schedule; returns the
        learning rate the step used."""
        observer = self.observer
        if self.clocked:
            # A rank that computes no loss (a pipeline's earlier stage) counts the step up to here.
            ready = self._loss_known if self._loss_known > self._step_began else time.perf_counter()
            self.own_s += ready - self._step_began
        if self.count is not None:
            if not self.count.finish(self.model):
                # Every rank learns it in the same all-reduce; the loss stays the model's (its check
                # is over), and the next steps are those of a run without counting.
                self.count = None
            if observer is not None:
                observer.counted(self.count.factor if self.count is not None else 1.0)
        if observer is not None:
            observer.synced()
        if self.clip is not None:
            self.strategy.clip_grad_norm(self.model, self.optimizer, self.clip)
        if not self._measured:
            self.gradient_bytes, self._measured = gradient_bytes(self.model), True
        self.strategy.optimizer_step(self.optimizer)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        if observer is not None:
            observer.stepped()
        if self.clocked:
            self._step_began = time.perf_counter()
        return lr

    def _plain_micro(self, batch: Batch) -> torch.Tensor:
        """:meth:`micro` for a plain step (``Strategy.plain_step``): ``HandWrittenLoop.forward_backward``
        with its empty contexts and hooks left out, the same operations in the same order."""
        x, y = batch
        loss = self._loss_fn(call_model(self.model, x), y)
        scale = batch.plan.loss_scale
        # x * 1.0 is x, bit for bit: skipped, as HandWrittenLoop.backward skips it.
        (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    def _plain_update(self) -> float:
        """:meth:`update` for a plain step: clip, ``optimizer.step()``, ``zero_grad``, the schedule."""
        optimizer = self.optimizer
        if self.clip is not None:
            self.strategy.clip_grad_norm(self.model, optimizer, self.clip)
        if not self._measured:
            self.gradient_bytes, self._measured = gradient_bytes(self.model), True
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        return lr
