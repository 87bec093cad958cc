"""What a model saves besides its parameters: its buffers, named as in ``state_dict``, once each.

A ``state_dict`` lists a tied weight (an LM's embedding reused as its output head) under every
name it has, and a buffer registered twice likewise: comparing the keys naively would count
the tied weight as a buffer, or one tensor twice. Here every tensor is counted once, under its
first name, and parameters (under any of their names) are never buffers.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


def parameter_names(module: nn.Module) -> set[str]:
    """Every name under which ``module`` holds a parameter, tied aliases included."""
    return {name for name, _ in module.named_parameters(remove_duplicate=False)}


def unique_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s ``state_dict`` tensors, each once under its first key (a tied alias is left out).

    Entries that are not tensors (a module's ``get_extra_state``) are left out: nothing to compare numerically.
    """
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def saved_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``module``'s ``state_dict`` saves that are no parameter (BatchNorm statistics,
    an EMA of the features, a step counter), by name, each once; not copied."""
    params = parameter_names(module)
    return {name: t for name, t in unique_state(module) if name not in params}
