"""Exact losses over -100 padding: a step's loss is the mean over the real targets of the WHOLE
step (every micro-batch of every rank), as one process computes it on the whole batch.

Cross-entropy skips targets of -100 (PyTorch's ``ignore_index``, Hugging Face's padding and
masked prompt tokens). A loss that is the mean over each micro-batch's own real targets, weighted
by the micro-batch's share of the step's SAMPLES (what the step does for a per-sample mean), is
not the mean over the step's real targets once the micro-batches hold different counts of -100:
N ranks x A micro-steps then train another model than one process. Where the targets may hold
-100 (:func:`counting_for`), the step does this instead:

1. Each micro-batch backpropagates its loss SUMMED over its real targets, divided by a fixed
   divisor, its samples x :attr:`Counting.per_sample`: with the per-sample weight that the step
   and the strategies give a micro-batch (``loss_scale``), every micro-batch of every rank is
   then weighted by one and the same constant. scaleloop's own loss computes that sum itself
   (``tasks.resolve_loss(per_sample=...)``); a Hugging Face causal LM computing its own loss is
   told the divisor as ``num_items_in_batch``, which makes its loss the sum divided by it.
2. The step counts each micro-batch's real targets as it goes (no wait for the device), and once
   per step, after the last backward has synchronised the gradients and before clipping and the
   optimizer, sums the count over the ranks (one all-reduce of three numbers) and multiplies the
   gradients, and the step's losses, by ``samples x per_sample / real targets`` of the step:
   gradients are linear in the loss, so the update is exactly that of the mean over the step's
   real targets, whatever the split. (The reported training loss is then each step's mean over
   its real targets.)

Runs whose targets hold no -100 (known for data held in memory and for datasets that say so with
a ``padded`` attribute) take none of this: their steps are what they were, bit for bit, and pay
nothing. A model whose own loss is a mean over each micro-batch's real targets and that cannot
be told the step's count (a model of your own, one whose ``forward`` ignores
``num_items_in_batch``) cannot be exact: the run says so in a note, and ``scaleloop verify``
names that cause (``verify.diagnose``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from scaleloop.data.batch import TargetRoute, takes_keyword
from scaleloop.data.datasets import IGNORE_INDEX, targets_padded
from scaleloop.data.info import DataInfo
from scaleloop.data.loader import Batch
from scaleloop.loop.tasks import LossFn, prediction_of
from scaleloop.runtime.collectives import sum_over_ranks
from scaleloop.runtime.dist import DistEnv

#: The keyword a Hugging Face model takes the divisor of its summed loss by (its Trainer passes it too).
ITEMS_KEYWORD = "num_items_in_batch"


@dataclass(frozen=True)
class Counting:
    """How a run's steps count real targets (see the module docstring)."""

    #: The divisor of a micro-batch's summed loss is its samples x this (the same on every rank).
    per_sample: int
    #: Count ``target[..., 1:]``: a causal LM shifts its labels inside its own loss (its first
    #: label predicts nothing), so only those after the first are targets.
    shift: bool = False
    #: The model computes its own loss and is told the divisor as ``num_items_in_batch``.
    tell: bool = False

    def count(self, target: torch.Tensor) -> torch.Tensor:
        """The real targets of a batch's ``target``, as a 0-d int64 tensor on its device."""
        counted = target[..., 1:] if self.shift else target
        return (counted != IGNORE_INDEX).sum()

    def divisor(self, samples: int) -> int:
        """The divisor of the summed loss of a micro-batch of ``samples`` samples."""
        return samples * self.per_sample


def counting_for(info: DataInfo, train: Dataset, model: nn.Module, loss_spec: Optional[str],
                 keep_target: TargetRoute) -> tuple[Optional[Counting], list[str]]:
    """How the run counts real targets (None: it does not), and notes for the run's header.

    Counted: a classification or language-modelling task without ``--loss`` (a loss of the
    user's is a mean over samples, docs/verification.md) whose targets hold -100, or, for
    language modelling, may (a dataset that is not held in memory and does not say). The loss
    is scaleloop's when the model is not given the target; when it is (a model computing its own
    loss), only a Hugging Face causal LM can be told the count (:func:`_told_model`); any other
    own loss stays as it was, and with known padding a note says it is not exact.
    """
    if info.task not in ("lm", "classification") or loss_spec is not None:
        return None, []
    padded = targets_padded(train)
    if padded is False or (padded is None and info.task != "lm"):
        return None, []
    per_sample = max(1, int(info.input_shape[-1])) if info.task == "lm" and info.input_shape else 1
    exact = ("the mean over the real targets of the whole step, over all ranks and micro-batches, as one process "
             "computes it")
    if not keep_target:
        return Counting(per_sample), ([f"note: the targets hold -100 (padding): each step's loss is {exact}"]
                                      if padded else [])
    if keep_target is True and _told_model(model):
        return Counting(per_sample, shift=True, tell=True), [
            f"note: the labels hold -100 (padding): each step's loss is the model's own, told {ITEMS_KEYWORD}, "
            f"and so {exact}"] if padded else []
    if not padded:
        return None, []
    return None, ["note: the targets hold -100 (padding) and the model computes its own loss, which cannot be told "
                  "the step's count of real targets: if it is a mean over each micro-batch's own real targets, "
                  "micro-batches with fewer of them weigh more, and N processes or --accumulate train a slightly "
                  "different model than one process (scaleloop verify names this); return the logits instead and "
                  "let scaleloop compute the loss, with labels that are each position's target "
                  "(docs/models-and-data.md, 'Padding')"]


def _told_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM whose own loss divides by ``num_items_in_batch``
    when given it (its ``loss_function`` is transformers' ``ForCausalLMLoss``, and its forward
    takes the keyword). The first micro-batches confirm it (:class:`StepCount`)."""
    utils = sys.modules.get("transformers.loss.loss_utils")
    causal = getattr(utils, "ForCausalLMLoss", None) if utils is not None else None
    if causal is None or not takes_keyword(model, ITEMS_KEYWORD):
        return False
    try:
        return getattr(model, "loss_function", None) is causal
    except Exception:   # a model's own property may raise anything: then it is not one
        return False


class StepCount:
    """A run's counting of real targets, step by step (module docstring), for ``loop.step.train_step``.

    Every rank calls :meth:`finish` once per step (it holds the all-reduce), whether or not it
    computed a loss (a pipeline's earlier stages load no target and count none). Once the model
    turned out not to take the count (:meth:`finish` learns it on every rank at once), the count
    is off: the run goes on as one without counting, and the calls here change nothing.
    """

    def __init__(self, counting: Counting, env: DistEnv, data_parallel: int) -> None:
        self.counting = counting
        self.env = env
        self.data_parallel = data_parallel
        self._counted = torch.zeros((), dtype=torch.int64, device=env.device)
        self._holds_target = False
        self._samples = 0                          # of the whole step, over all ranks
        self._losses: list[torch.Tensor] = []
        # A told model is confirmed to divide by num_items_in_batch on its first conclusive
        # micro-batch; one that does not is "refused", and the run goes on as without counting.
        self._confirmed = not counting.tell
        self._refused = False
        #: Off after a refusal, on every rank alike: nothing is counted or weighted any more.
        self.off = False
        #: The real targets of the steps since :meth:`take_targets` (all ranks'): a log row's tokens.
        self._targets = 0.0

    def batch(self, batch: Batch) -> Batch:
        """Count ``batch``'s real targets; the batch to train on (a told model's inputs get the divisor)."""
        if self.off:
            return batch
        x, y = batch
        self._samples = batch.place.step_samples
        if y is not None:
            self._counted += self.counting.count(y)
            self._holds_target = True
        if self.counting.tell and not self._refused and isinstance(x, dict):
            return Batch({**x, ITEMS_KEYWORD: self.counting.divisor(len(batch))}, y, batch.place)
        return batch

    def keep(self, loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The micro-batch's loss as the step returns it: a copy, multiplied in :meth:`finish`."""
        if loss is None or self.off:
            return None
        kept = loss.detach().clone()
        self._losses.append(kept)
        return kept

    def checked(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn``, which for a told model also confirms that its loss is the summed one."""
        if self._confirmed or self.off:
            return loss_fn

        def confirming(output: Any, target: Any) -> torch.Tensor:
            loss = loss_fn(output, target)
            if not self._confirmed and not self._refused and isinstance(target, torch.Tensor):
                self._confirm(loss, output, target)
            return loss

        return confirming

    def _confirm(self, loss: torch.Tensor, output: Any, target: torch.Tensor) -> None:
        """Compare the told model's loss with the summed loss it must be: a model that ignored
        ``num_items_in_batch`` returned a mean. Inconclusive where the divisor equals the count."""
        divisor = self.counting.divisor(len(target))
        if int(self.counting.count(target)) == divisor:
            return   # a mean and the summed loss are the same number here: the next micro-batch decides
        with torch.no_grad():
            logits = prediction_of(output).detach().float()
            labels = target
            if self.counting.shift:
                logits, labels = logits[..., :-1, :], target[..., 1:]
            summed = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum",
                                     ignore_index=IGNORE_INDEX)
            told = float(loss.detach().float()) * divisor
        expected = float(summed)
        if abs(told - expected) <= 1e-4 * max(abs(expected), 1e-6):
            self._confirmed = True
        else:
            self._refused = True

    def take_targets(self) -> Optional[float]:
        """The real targets of the steps since the last call (summed over the ranks, as
        :meth:`finish` learnt them: nothing is read from the device here); None once :attr:`off`."""
        targets, self._targets = self._targets, 0.0
        return None if self.off else targets

    def finish(self, model: nn.Module) -> float:
        """After the step's last backward (gradients synchronised): sum the count over the ranks and
        multiply the gradients and the step's losses (module docstring, 2); returns the factor
        (1.0: nothing was multiplied). Where the model turned out not to take the count, every
        rank learns it here at once and the count is :attr:`off` from then on."""
        if self.off:
            return 1.0
        losses, self._losses = self._losses, []
        vector = torch.stack([self._counted.double(),
                              torch.tensor(float(self._holds_target), dtype=torch.float64, device=self.env.device),
                              torch.tensor(float(self._refused), dtype=torch.float64, device=self.env.device)])
        self._counted.zero_()
        self._holds_target = False
        counted, holders, refused = sum_over_ranks(vector, self.env).tolist()
        if refused:
            if self.env.is_main:
                print(f"note: the model's own loss did not follow {ITEMS_KEYWORD} (a mean over each micro-batch's "
                      "real targets, not their sum divided by it): the run goes on without counting real targets, "
                      "and is not exact over -100 padding (docs/models-and-data.md, 'Padding')")
            self.off = True
            return 1.0
        # Ranks that share a batch share (tensor-parallel ranks; a pipeline's last stages only hold
        # targets) counted the same targets: each share is counted once.
        real = counted * self.data_parallel / holders if holders else 0.0
        self._targets += real
        if real <= 0:
            return 1.0   # no real target in the step: its gradients are zero whatever the weight
        factor = self._samples * self.counting.per_sample / real
        if factor != 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)
                for loss in losses:
                    loss.mul_(factor)
        return factor

