"""A model's blocks: the modules that FSDP shards as units of their own, that activation
checkpointing recomputes and that ``plan`` counts. No strategy here, so that all of them ask the
one finder (:func:`find_blocks`) without importing each other.

The first rule that gives blocks wins:

1. the model's own ``fsdp_blocks()`` method: the user's word, taken as it is;
2. transformers' ``_no_split_modules``: the layer classes a Hugging Face model declares (on it
   or on any of its modules), e.g. ``LlamaDecoderLayer``, ``GPT2Block``; every module of a listed
   class, the outermost only (a listed class inside another is part of it);
3. the largest stack of one class: the ``nn.ModuleList`` or ``nn.Sequential`` holding the most
   parameters whose members are all of one class (torchtitan's ``layers``, timm's ``blocks``,
   nanoGPT's ``transformer.h``, TinyGPT's ``blocks``, BERT's ``encoder.layer``);
4. else the children that hold parameters, after stepping down through a chain of single
   parameter-holding children (SimpleNet's two ``Linear``; ConvNet's ``features`` and ``head``).
   A model of one layer has none: FSDP makes it one unit, and activation checkpointing refuses.

What was found is said in the run's first line (``fsdp (5 units: 4 x LlamaDecoderLayer + root)``)
and in activation checkpointing's note, never left to be guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from torch import nn

from scaleloop.errors import UsageError

#: What a model can do to name its blocks itself, for the lines that say none were found.
DECLARE = "give the model an fsdp_blocks() method returning its blocks (e.g. its list of layers)"


@dataclass(frozen=True)
class Blocks:
    """A model's blocks (in the model's order) and which rule found them, in words."""

    modules: list[nn.Module]
    source: str

    def __len__(self) -> int:
        return len(self.modules)

    def describe(self) -> str:
        """What the blocks are by class: ``4 x LlamaDecoderLayer``, ``Sequential + Linear``."""
        return count_classes(self.modules)


def count_classes(modules: Iterable[nn.Module]) -> str:
    """``modules`` by class name in order of first appearance: ``2 x Linear + BatchNorm2d`` ('' for none)."""
    counts: dict[str, int] = {}
    for module in modules:
        name = type(module).__name__
        counts[name] = counts.get(name, 0) + 1
    return " + ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _has_own_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> Blocks:
    """The model's blocks by the first rule of the module docstring that gives any."""
    custom = getattr(model, "fsdp_blocks", None)
    if callable(custom):
        blocks = list(custom())
        wrong = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module)]
        if wrong:
            raise UsageError(f"{type(model).__name__}.fsdp_blocks() must return modules, got {', '.join(wrong)}")
        return Blocks([b for b in blocks if b is not model], "named by fsdp_blocks()")
    declared = _declared(model)
    if declared:
        return Blocks(declared, "declared by _no_split_modules")
    stack = _largest_stack(model)
    if stack is not None:
        name, members = stack
        return Blocks(members, f"the largest stack of one class ({name or 'the model itself'})")
    return Blocks(_parts(model), "the model's parts: it declares no blocks")


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of :func:`find_blocks`, without how they were found."""
    return find_blocks(model).modules


def _declared(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose class a ``_no_split_modules`` of the model (or of a module in
    it: a composite model's parts declare their own) names; [] when none is declared or found."""
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if listed is None:
            continue
        listed = [listed] if isinstance(listed, str) else listed
        if not isinstance(listed, (list, tuple, set)) or not all(isinstance(n, str) for n in listed):
            raise UsageError(f"{type(module).__name__}._no_split_modules must be a list of class names, "
                             f"got {listed!r}")
        names.update(listed)
    if not names:
        return []
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in seen:
                continue   # a module reached twice (shared) is one block
            seen.add(id(child))
            if type(child).__name__ in names:
                if _has_params(child):
                    found.append(child)
            else:
                visit(child)   # only the outermost: a listed class inside a block is part of it

    visit(model)
    return found


def _largest_stack(model: nn.Module) -> Optional[tuple[str, list[nn.Module]]]:
    """The ``ModuleList`` or ``Sequential`` with the most parameters whose members are all of one
    class, with its name, and its members that hold parameters; None when there is none.

    By parameters, not by members: a mixture-of-experts layer's list of 64 experts sits inside
    each of the 12 layers of the list that holds them all. A ``Sequential`` needs two members or
    more (one member is a wrapper, not a stack); a ``ModuleList`` has no forward of its own, so
    even one member is a declared stack (a one-layer TinyGPT keeps its block). Ties go to the
    outermost (``named_modules`` lists parents first)."""
    best: Optional[tuple[str, list[nn.Module]]] = None
    best_size = 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        members = list(module)
        if len(members) < (1 if isinstance(module, nn.ModuleList) else 2):
            continue
        if len({type(m) for m in members}) != 1:
            continue
        size = _count(module)
        if size > best_size:
            best, best_size = (name, [m for m in members if _has_params(m)]), size
    return best


def _parts(model: nn.Module) -> list[nn.Module]:
    """The children that hold parameters, below a chain of single parameter-holding children."""
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
