"""How an evaluation scores a model: the task's loss summed over ranks exactly, its correct
predictions, and the user's own metrics (``--metrics``). Training's losses are ``loop.tasks``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError

#: ``metric(prediction, target) -> tensor``: one value per sample, or the batch's mean.
MetricFn = Callable[[torch.Tensor, Any], torch.Tensor]


def resolve_metrics(spec: Optional[str]) -> dict[str, MetricFn]:
    """The user's metrics, ``pkg.module:fn[,pkg.module:fn2...]``, by the function's name."""
    if not spec:
        return {}
    from scaleloop.plugins import resolve_factory

    metrics: dict[str, MetricFn] = {}
    for one in (part.strip() for part in spec.split(",") if part.strip()):
        fn = resolve_factory(one, "metrics")
        name = getattr(fn, "__name__", one.rsplit(":", 1)[-1])
        metrics[name if name not in metrics else one] = _checked_metric(one, fn)
    return metrics


def _checked_metric(spec: str, fn: Callable[..., Any]) -> MetricFn:
    def metric(prediction: torch.Tensor, target: Any) -> torch.Tensor:
        value = fn(prediction, target)
        if not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"--metrics {spec!r} returned {type(value).__name__}; return a tensor of one value "
                                 "per sample, or the batch's mean") from None
        if value.dim() > 1 or (value.dim() == 1 and len(value) not in (1, len(prediction))):
            raise UsageError(f"--metrics {spec!r} returned a tensor {list(value.shape)} for a batch of "
                             f"{len(prediction)}; return one value per sample, or the batch's mean")
        return value

    return metric


def task_loss_sum(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the task's loss summed over the batch's predictions in float64, predictions): tokens for
    ``lm``, samples otherwise (a regression sample's loss is the mean over its values, as in training).

    Per-prediction losses are computed in at least float32, then added up in float64, so the
    total does not depend on how the samples were cut into ranks and batches.
    """
    out = output.to(torch.promote_types(output.dtype, torch.float32))
    if info.task == "binary":
        losses = F.binary_cross_entropy_with_logits(out, target.to(out.dtype).view_as(out), reduction="none")
    elif info.task == "lm":
        target = target.flatten()
        losses = F.cross_entropy(out.flatten(0, -2), target, reduction="none")[target != -100]  # -100: no target
    elif info.task == "regression":
        losses = F.mse_loss(out, target.to(out.dtype).view_as(out), reduction="none").reshape(len(out), -1).mean(1)
    else:
        losses = F.cross_entropy(out, target, reduction="none")
    return losses.double().sum(), losses.numel()


def correct_count(info: DataInfo, output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions made) — tokens for ``lm``, samples otherwise; (0, 0)
    for regression, which has no accuracy."""
    if info.task == "regression":
        return 0, 0
    if info.task == "binary":
        pred = (output > 0).to(target.dtype).view_as(target)
        return int((pred == target).sum()), target.numel()
    pred = output.argmax(dim=-1)
    counted = target != -100  # cross-entropy's ignore index: padding
    return int(((pred == target) & counted).sum()), int(counted.sum())
