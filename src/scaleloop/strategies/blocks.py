"""A model's blocks: the modules that FSDP shards as units of their own and that activation
checkpointing recomputes (rules: docs/strategies.md, "--strategy fsdp"). No strategy here, so
that both can ask without importing each other.
"""
from __future__ import annotations

from torch import nn

from scaleloop.errors import UsageError


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _has_own_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units of their own (rules in the module docstring)."""
    custom = getattr(model, "fsdp_blocks", None)
    if callable(custom):
        blocks = list(custom())
        wrong = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module)]
        if wrong:
            raise UsageError(f"{type(model).__name__}.fsdp_blocks() must return modules, got {', '.join(wrong)}")
        return [b for b in blocks if b is not model]
    listed = getattr(model, "blocks", None)
    if isinstance(listed, (nn.ModuleList, nn.Sequential)):
        return [b for b in listed if _has_params(b)]
    container = model
    while True:
        children = [c for c in container.children() if _has_params(c)]
        if len(children) == 1 and not _has_own_params(container):
            container = children[0]
            continue
        return children


def untied_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` that ``fully_shard`` can take: a ModuleList or ModuleDict gives way to its
    members, and a block that shares a parameter with a module outside it (tied weights,
    such as a language model's input embedding and output layer) gives way to its children:
    FSDP shards each parameter in exactly one unit, so tied parameters stay in a unit that
    holds every module using them (at the end, the root's)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    units: list[nn.Module] = []
    for block in blocks:
        inside: dict[int, int] = {}
        for _, param in block.named_parameters(remove_duplicate=False):
            inside[id(param)] = inside.get(id(param), 0) + 1
        # A ModuleList or ModuleDict has no forward of its own: its members become the units.
        container = isinstance(block, (nn.ModuleList, nn.ModuleDict))
        if not container and all(uses[key] == n for key, n in inside.items()):
            units.append(block)
        else:
            units += untied_units(model, [c for c in block.children() if _has_params(c)])
    return units
