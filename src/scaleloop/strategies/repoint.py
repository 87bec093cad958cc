"""An optimizer the user built on their own model, moved onto the parameters a strategy made.

``strategy.setup(model, optimizer)`` takes an optimizer object as well as a ``params -> optimizer``
factory. Making a model parallel can replace its parameters: FSDP2's ``fully_shard`` and tensor
parallelism swap each for a DTensor, and a pipeline stage keeps only some. An optimizer built
before that would step tensors the model no longer uses, and the model would never change. So the
optimizer's groups are re-pointed, as Accelerate's ``prepare`` does for FSDP2:

1. before the model is touched (:func:`check_optimizer`): every parameter the optimizer holds is
   named by its name(s) in the user's module; an optimizer that holds state (it has stepped, or
   makes its state when built, as Adagrad does), holds a tensor that is not one of the model's, or
   keeps references to its parameters outside its groups (``ZeroRedundancyOptimizer``) is refused
   in one line that says to pass the factory form instead;
2. after (:func:`repoint`): each group's ``params`` list is refilled, in place, with the parameters
   the strategy made under the same names (FSDP2, TP and activation checkpointing keep names; a
   wrapper's prefix is dropped by ``Strategy.unwrap``; a pipeline stage maps its names to the
   whole model's). Every hyper-parameter of every group stays as the user set it.

Why re-point the user's object rather than build a new one of its class: the object is what the
user already holds, and what an LR scheduler made before ``setup`` holds (it steps that object's
groups); a rebuilt optimizer would leave both stepping nothing, which is the silent failure this
module exists to prevent. For the same reason a pipeline stage's groups are kept even when it holds
none of a group's parameters (an empty group steps nothing): a scheduler's per-group values stay
aligned with the groups they were made for. The lists are refilled in place because some
optimizers keep the group's list itself (``LBFGS._params``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from scaleloop.errors import UsageError


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> its names`` in ``model`` (a tied parameter has several), inside any
    ``torch.compile`` wrapper (the names a strategy's ``unwrap`` gives back)."""
    inner = getattr(model, "_orig_mod", None)
    module = inner if isinstance(inner, nn.Module) else model
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _factory_hint(optimizer: torch.optim.Optimizer) -> str:
    return (f"pass a factory instead, which the strategy calls with the parameters it made: "
            f"strategy.setup(model, lambda params: {type(optimizer).__name__}(params, ...))")


def check_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, list[str]]) -> None:
    """Refuse (UsageError, one line) an optimizer object that cannot be moved onto the parameters
    a strategy makes; ``names`` is :func:`parameter_names` of the user's model. Call it before
    the model is made parallel, so that nothing has been done when it refuses."""
    cls, fix = type(optimizer).__name__, _factory_hint(optimizer)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    # (``state`` is a defaultdict: an entry may exist, empty, for a parameter merely looked up.)
    stateful = sum(1 for value in optimizer.state.values() if value)
    if stateful:
        raise UsageError(f"setup got a {cls} that already holds state for {stateful} parameter(s) (it has "
                         f"stepped, or makes its state when built), which cannot follow the parameters the "
                         f"strategy makes; {fix}")
    foreign = [p for p in held if id(p) not in names]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UsageError(f"setup got a {cls} holding {len(foreign)} tensor(s) that are not parameters of the "
                         f"model (shapes {shapes}); build it on model.parameters(), or {fix}")
    kept = _outside_groups(optimizer, {id(p) for p in held})
    if kept:
        raise UsageError(f"setup got a {cls} that keeps its own references to its parameters (in "
                         f"{', '.join(kept)}), which cannot be moved onto the parameters the strategy makes; {fix}")


def _outside_groups(optimizer: torch.optim.Optimizer, held: set[int]) -> list[str]:
    """The optimizer's attributes that reference a parameter it holds other than through its
    groups (a group's own ``params`` list, kept as an attribute, is refilled in place: fine)."""
    group_lists = {id(group["params"]) for group in optimizer.param_groups}

    def refers(value: Any, depth: int) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) in held
        if depth == 0 or id(value) in group_lists:
            return False
        if isinstance(value, Mapping):
            return any(refers(k, depth - 1) or refers(v, depth - 1) for k, v in value.items())
        if isinstance(value, (list, tuple, set, frozenset)):
            return any(refers(v, depth - 1) for v in value)
        return False

    return [name for name, value in vars(optimizer).items()
            if name not in ("param_groups", "state", "defaults") and refers(value, 4)]


def repoint(optimizer: torch.optim.Optimizer, names: Mapping[int, list[str]], made: Mapping[str, torch.Tensor],
            *, part: bool = False) -> None:
    """Refill each of ``optimizer``'s groups with the parameters the strategy made: ``made`` maps
    the user's names to them; ``names`` is :func:`parameter_names` taken before (and checked by
    :func:`check_optimizer`). ``part``: this rank holds part of the model (a pipeline stage), and
    a parameter it does not hold leaves its group; otherwise a missing one is a strategy's bug."""
    for group in optimizer.param_groups:
        params, kept_names = [], []
        labels = group.get("param_names")   # optimizers built on named_parameters() keep the names
        for i, old in enumerate(group["params"]):
            new = next((made[name] for name in names[id(old)] if name in made), None)
            if new is None:
                if part:
                    continue
                raise RuntimeError(f"setup: the strategy made no parameter named {names[id(old)][0]!r} to move "
                                   "the optimizer onto (strategies/repoint.py)")
            params.append(new)
            if labels is not None:
                kept_names.append(labels[i])
        group["params"][:] = params
        if labels is not None:
            labels[:] = kept_names
    # Only empty entries can be there (check_optimizer), keyed by the old parameters: they would
    # make state_dict() look for parameters the groups no longer hold.
    optimizer.state.clear()
