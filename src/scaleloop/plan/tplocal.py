"""One tensor-parallel rank's share of a model, built to be traced (no process group, no memory).

A rank of a ``tp``-way split computes its layers' slices on whole inputs: a ``colwise`` Linear
(``colwise:N`` too: each of its N parts is cut alike) has ``out_features / tp`` outputs, a
``rowwise`` one ``in_features / tp`` inputs and all of its outputs (summed over the ranks after).
:func:`shrink_to_rank` swaps each Linear that the model's ``tp_plan(tp)`` names for a meta Linear
of those sizes, so that a trace of the step (:mod:`scaleloop.plan.trace`) records what one rank
keeps, whatever the model does between its layers (heads read from the width, as TinyGPT and
Hugging Face's attention do). The trace does not hold the collectives' own temporaries: the
sums of a rowwise output and of a colwise input's gradient, one activation each, for the
moment of the sum.
"""
from __future__ import annotations

from torch import nn


def local_sizes(layer: nn.Linear, style: str, tp: int) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of ``layer``'s slice on one of ``tp`` ranks under ``style``
    (None: a style or a size this cannot cut)."""
    kind, _, parts = style.partition(":")
    split = int(parts) if parts.isdigit() else 1
    if kind == "colwise" and layer.out_features % (tp * split) == 0:
        return layer.in_features, layer.out_features // tp
    if kind == "rowwise" and not parts and layer.in_features % tp == 0:
        return layer.in_features // tp, layer.out_features
    return None


def shrink_to_rank(model: nn.Module, tp: int) -> bool:
    """Replace, in ``model`` (on the meta device), every Linear its ``tp_plan(tp)`` names by one
    rank's slice. False, and ``model`` left as it was, when the model has no plan or the plan holds
    a style other than ``colwise[:N]``/``rowwise`` on a Linear (a ``ParallelStyle`` object)."""
    plan_of = getattr(model, "tp_plan", None)
    if not callable(plan_of):
        return False
    try:
        plan = plan_of(tp)
    except ValueError:
        return False
    swaps: list[tuple[str, nn.Linear]] = []
    for name, style in plan.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            return False
        sizes = local_sizes(layer, style, tp) if isinstance(layer, nn.Linear) and isinstance(style, str) else None
        if sizes is None:
            return False
        swaps.append((name, nn.Linear(*sizes, bias=layer.bias is not None, device="meta", dtype=layer.weight.dtype)))
    for name, local in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, local)
    return True
