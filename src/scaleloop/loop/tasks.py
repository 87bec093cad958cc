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
Over -100 padding the run weighs real targets instead (``loop.padding``): the built-in loss is
then the summed one (``resolve_loss(per_sample=...)``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from scaleloop.data.batch import describe
from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError

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
    ``per_sample``: the built-in loss over -100 padding (``loop.padding``): not the mean over the
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
    loss over padding, ``loop.padding``; classification and lm only)."""
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
    if reduction != "mean":   # the summed cross-entropy (loop.padding); the mean's calls below stay as they were
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
