"""Memory levers that do not change what is computed: activation checkpointing, and how much
tensor memory a step needs at its peak on any device (the CPU included).

**Activation checkpointing** (``--activation-checkpointing``): each block of the model (the
units ``fsdp`` shards, found by ``strategies.blocks.find_blocks``: ``fsdp_blocks()``, transformers'
``_no_split_modules``, the largest stack of one class such as TinyGPT's ``blocks``)
keeps only its input from the forward; its intermediate activations are recomputed in the
backward, one block at a time. Same numbers (the forward is deterministic), less memory, about
one more forward of compute. It is ``torch.distributed._composable.checkpoint`` (non-reentrant,
as torchtitan's per-block choice), applied in place: parameter names and checkpoints do not change.

**Peak step memory on the CPU** (:func:`peak_step_bytes`): the CPU has no allocator statistics
like ``torch.cuda.max_memory_allocated``, and a process's RSS mixes torch's own libraries and
freed-but-kept pages with tensors. So the step is run under ``torch.profiler`` with
``profile_memory=True``, which records every allocation and free of the CPU allocator and the
op it happened in; the running sum of those, op by op in the order the ops end, at its
highest, is the step's peak of tensor memory beyond what existed before it (activations,
gradients; an op's own temporaries only as far as they outlive it). Costs a slow step; a
probe, not something to run every step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from scaleloop.errors import UsageError

if TYPE_CHECKING:
    from scaleloop.strategies.blocks import Blocks


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint the activations of each of the model's blocks (recomputed in the backward), in
    place; returns how many. UsageError when the model has no blocks to checkpoint."""
    return len(checkpoint_found_blocks(model))


def checkpoint_found_blocks(model: nn.Module) -> "Blocks":
    """:func:`checkpoint_blocks`, returning the blocks and how they were found (for the run's note)."""
    from torch.distributed._composable import checkpoint

    from scaleloop.strategies.blocks import DECLARE, find_blocks

    found = find_blocks(model)
    if not found.modules:
        raise UsageError(f"--activation-checkpointing checkpoints each block of the model, and {type(model).__name__} "
                         f"has none (a model of one layer, or one that declares none): {DECLARE}, or drop the flag")
    for block in found.modules:
        checkpoint(block)   # non-reentrant: works with FSDP2, TP and DDP, and with inputs that need no grad
    return found


def peak_step_bytes(step: Callable[[], Any]) -> int:
    """The highest tensor memory that ``step()`` allocates on the CPU beyond what existed before
    it (bytes; from the profiler's allocation events, see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Each op's own allocations minus its own frees (its children's are theirs), plus the
    # frees and allocations outside any op ("[memory]"), in the order the ops end: the live
    # tensor bytes after each op. Peaks inside one op (its temporaries) are not seen.
    changes = [(e.time_range.end, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
               for e in prof.events()]
    live = peak = 0
    for _, delta in sorted(changes, key=lambda c: c[0]):
        live += delta
        peak = max(peak, live)
    return peak
