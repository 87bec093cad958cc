"""Losses and metrics for each kind of target (see ``DataInfo.task``), the user's own loss, and
the one rule for what a model returns.

A model's output is read by one rule (:func:`prediction_of`, :func:`own_loss`):

- a tensor is the prediction;
- a tuple or list: its first element is the prediction;
- a mapping with ``logits``, or an object with a ``logits`` attribute (a Hugging Face
  ``ModelOutput``): that is the prediction;
- a mapping or object that also holds a ``loss`` (a Hugging Face model given ``labels``): the
  model computed its own loss, and without ``--loss`` that is the loss trained on;
- a pair ``(logits, loss)`` from a model that was given the target (nanoGPT's ``forward(idx,
  targets)``; ``data.batch.keeps_target``): its one-value ``loss`` is the model's own, as above.
  (Only then: a pair such as ``(output, aux_loss)`` from a model that never saw the target is
  not its training loss.)

Every loss a run trains with is a ``loss_fn(output, target)`` returning the MEAN loss over the
batch's samples: the step weights each micro-batch by its share of the global step, which
makes N ranks x K micro-steps equal one process only for a sample-weighted mean (see
docs/verification.md for losses normalised otherwise, such as a model's own per-token loss).
Over -100 padding the run weighs real targets instead (below): the built-in loss is
then the summed one (``resolve_loss(per_sample=...)``).

Exact losses over -100 padding: a step's loss is the mean over the real targets of the WHOLE
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
   (``resolve_loss(per_sample=...)``); a Hugging Face causal LM computing its own loss is
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
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from scaleloop.data.batch import TargetRoute, describe, takes_keyword
from scaleloop.data.datasets import IGNORE_INDEX, targets_padded
from scaleloop.data.info import DataInfo
from scaleloop.data.loader import Batch
from scaleloop.errors import UsageError
from scaleloop.runtime.collectives import sum_over_ranks
from scaleloop.runtime.dist import DistEnv


#: ``loss_fn(output, target) -> scalar tensor``, the mean over the batch; ``output`` is what the
#: model returned (read by :func:`prediction_of`), ``target`` the batch's target.
LossFn = Callable[[Any, Any], torch.Tensor]

#: What a model may return, said in the one-line error for anything else.
OUTPUT_RULE = ("a tensor, a tuple or list whose first element is the prediction, or a mapping or object "
               "with 'logits' (a Hugging Face ModelOutput) or with its own 'loss'")


def prediction_of(output: Any) -> torch.Tensor:
    """The prediction in a model's output, by the rule in this module's docstring."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise UsageError(f"the model returned {describe(output)}; expected {OUTPUT_RULE}")


def own_loss(output: Any, given_target: bool = False) -> Optional[torch.Tensor]:
    """The loss the model computed itself (a Hugging Face model given ``labels``), or None.

    ``given_target``: the model was called with the target, so a pair ``(logits, loss)`` holding a
    one-value floating tensor second is its own loss (the rule in this module's docstring).
    """
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, (tuple, list)):
        second = output[1] if given_target and len(output) >= 2 else None
        if isinstance(second, torch.Tensor) and second.numel() == 1 and second.is_floating_point():
            return second
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def resolve_loss(spec: Optional[str], info: DataInfo, given_target: bool = False,
                 per_sample: Optional[int] = None) -> LossFn:
    """The user's ``pkg.module:fn`` (given the prediction and the target; checked to return a
    scalar), or the model's own loss when it returns one, else the built-in loss for ``info``.

    ``given_target``: the model is called with the target (``data.batch.keeps_target``).
    ``per_sample``: the built-in loss over -100 padding (:func:`counting_for`): not the mean over the
    batch's real targets but their summed loss divided by the batch's samples x ``per_sample``.
    """
    if spec is None:
        def mean(output: Any, target: Any) -> torch.Tensor:
            if type(output) is torch.Tensor:  # the common case first: one type check per step
                return task_loss(info, output, target)
            loss = own_loss(output, given_target)
            if loss is not None:
                return loss.reshape(()) if loss.numel() == 1 else loss.mean()
            if target is None:
                raise UsageError("the batch has no target (no 'labels' entry) and the model returned no 'loss'; "
                                 "give the batch labels or return the loss from the model")
            return task_loss(info, prediction_of(output), target)

        def summed(output: Any, target: Any) -> torch.Tensor:
            divisor = len(target) * per_sample   # type: ignore[operator]
            if type(output) is not torch.Tensor:
                loss = own_loss(output, given_target)
                if loss is not None:
                    # A model not given the target that still returns a loss: read as a mean over
                    # the target's real entries (the closest reading there is).
                    real = (target != -100).sum() if isinstance(target, torch.Tensor) else divisor
                    return (loss.reshape(()) if loss.numel() == 1 else loss.mean()) * (real / divisor)
                if target is None:
                    return mean(output, target)   # its one-line error
                output = prediction_of(output)
            return task_loss(info, output, target, reduction="sum") / divisor

        # Decided once, here: the common case pays no test per step.
        builtin = mean if per_sample is None else summed
        # Classes known only from the model's output width: the first batch's labels are checked
        # against it, in one line rather than a CUDA device-side assert.
        return builtin if info.num_classes is not None else _labels_within_output(info, builtin)
    from scaleloop.plugins import resolve_factory

    fn = resolve_factory(spec, "loss")
    if isinstance(fn, type):
        fn = _loss_instance(spec, fn)

    def loss_fn(output: Any, target: Any) -> torch.Tensor:
        loss = fn(prediction_of(output), target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"--loss {spec!r} returned {shape}, not a scalar tensor; "
                             "return the mean loss over the batch")
        return loss.reshape(())

    return loss_fn


def _loss_instance(spec: str, cls: type) -> Callable[..., Any]:
    """``--loss torch.nn:SmoothL1Loss`` names a class: what is meant is an instance with its defaults
    (called with the prediction and the target, the class itself would take them as settings)."""
    try:
        return cls()
    except TypeError as exc:
        raise UsageError(f"--loss {spec!r} is a class that cannot be made without arguments ({exc}); "
                         "give a function, or a module:name of a function that returns the loss") from None


def _labels_within_output(info: DataInfo, loss: LossFn) -> LossFn:
    """``loss``, whose first call checks that the target's class indices (tokens) fit the output."""
    checked = False

    def loss_fn(output: Any, target: Any) -> torch.Tensor:
        nonlocal checked
        if not checked and info.task in ("classification", "lm") and isinstance(target, torch.Tensor):
            checked = True
            try:
                width = prediction_of(output).shape[-1]
            except UsageError:   # no prediction (a model's own loss only): nothing to check against
                width = None
            labels = target[target != -100]
            if width is not None and labels.numel() and int(labels.max()) >= width:
                noun = "token" if info.task == "lm" else "class index"
                raise UsageError(f"the batch holds {noun} {int(labels.max())}, but the model outputs {width} "
                                 f"scores per prediction (dataset {info.name!r} does not say its number of "
                                 "classes, so the model's output width is taken as it): widen the model's output, "
                                 "or fix the labels")
        return loss(output, target)

    return loss_fn


#: The built-in loss of each task, as the run's header names it.
TASK_LOSSES = {"classification": "CrossEntropyLoss", "binary": "BCEWithLogitsLoss", "regression": "MSELoss",
               "lm": "CrossEntropyLoss (next token)"}


def describe_task(info: DataInfo, loss_spec: Optional[str] = None, model_takes_target: bool = False) -> str:
    """``task: <what>, loss <which>``: the line of the run's header that says what is learnt and how.

    ``loss_spec``: the user's ``--loss``; ``model_takes_target``: the model's ``forward`` takes
    the batch's ``labels`` (a Hugging Face model), so it is expected to return its own loss.
    """
    n = info.num_classes
    if info.task == "classification":
        what = f"classification over {n} classes" if n is not None else \
            "classification (classes: the model's output width)"
    elif info.task == "binary":
        what = f"multi-label (binary) over {n} labels" if n and n > 1 else "binary"
    elif info.task == "regression":
        what = f"regression of {n} values per sample" if n and n > 1 else "regression"
    elif info.task == "lm":
        what = f"language modelling over {n} tokens" if n is not None else \
            "language modelling (vocabulary: the model's output width)"
    else:
        what = "none (the samples hold no target)"
    if loss_spec is not None:
        loss = f"loss {loss_spec} (--loss)"
    elif model_takes_target or info.task == "none":
        loss = "loss: the model's own"
    else:
        loss = f"loss {TASK_LOSSES[info.task]}"
    return f"task: {what}, {loss}"


def task_loss(info: DataInfo, output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean loss over the batch: cross-entropy, binary cross-entropy on logits, next-token CE,
    or mean squared error (regression). A prediction whose shape cannot fit the target is one
    line naming both shapes and the likely cause (:func:`shape_mismatch`).

    ``reduction="sum"``: summed instead (cross-entropy over its real targets, -100 skipped: the
    loss over padding, :func:`counting_for`; classification and lm only)."""
    try:
        return _task_loss(info, output, target, reduction)
    except (RuntimeError, ValueError) as exc:
        said = shape_mismatch(info, output, target)
        if said is None:
            raise
        raise UsageError(said) from exc


def shape_mismatch(info: DataInfo, output: torch.Tensor, target: Any) -> Optional[str]:
    """Why ``output`` cannot be the prediction for ``target`` under ``info.task``, in one line; None
    when the shapes fit (the error was something else)."""
    if not isinstance(target, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    got, want = list(output.shape), list(target.shape)
    if info.task in ("classification", "lm"):
        per = "target token" if info.task == "lm" else "sample"
        rows = output.shape[:-1].numel() if output.dim() >= 2 else -1
        if rows == target.numel() and (info.task == "lm" or output.dim() == target.dim() + 1):
            return None
        if output.dim() == target.dim() + 1 and got[:1] + got[2:] == want:
            return None   # scores in dimension 1, as cross-entropy takes them for images: [B, C, H, W]
        expected = f"one row of class scores per {per}, e.g. [{', '.join(str(n) for n in want)}, C]"
        if output.dim() >= 2 and rows < target.numel() and rows and target.numel() % rows == 0:
            cause = (f"the model returns {rows} row(s) of scores but the target holds {target.numel()} labels: "
                     "it predicts fewer positions than the target has (e.g. only the last position's logits, "
                     "as a model called without its targets may do); return the logits of every position")
        else:
            cause = "the model's output and the dataset's target disagree on the batch's layout"
    else:
        if output.numel() == target.numel():
            return None
        expected = f"{target.numel() // max(len(target), 1)} value(s) per sample, as the target {want} has"
        cause = "the model's output width is not the number of targets per sample"
    return f"the model's prediction {got} does not fit the target {want} ({info.task}: {expected}); likely: {cause}"


def _task_loss(info: DataInfo, output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if reduction != "mean":   # the summed cross-entropy (counting_for); the mean's calls below stay as they were
        if info.task == "lm":
            return F.cross_entropy(output.float().flatten(0, -2), target.flatten(), reduction=reduction)
        return F.cross_entropy(output.float(), target, reduction=reduction)
    if info.task == "binary":
        return F.binary_cross_entropy_with_logits(output.float(), target.float().view_as(output))
    if info.task == "lm":
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())
    if info.task == "regression":
        return F.mse_loss(output.float(), target.float().view_as(output))
    return F.cross_entropy(output.float(), target)


# --- exact losses over -100 padding ---------------------------------------------------------------

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
