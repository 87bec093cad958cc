"""Parameters that get no gradient in a step (conditional computation: an auxiliary head used on
some steps, a rarely routed expert), and the rule every strategy follows for them: one process's.

One process trains on the whole global batch, so a parameter gets a gradient when any sample of
the step used it, that is, when any RANK used it: the ranks that did not add zeros to the
average, which is exact. A parameter no rank used gets no gradient in one process: its ``.grad``
stays None, and torch's optimizers then neither step it nor touch its momentum or Adam state
(zeros in its place would: momentum carries on, Adam's averages decay, weight decay shrinks it).

:func:`used_anywhere` is the one small all-reduce that tells every rank which case each
parameter is in; the strategies that average gradients themselves (``allreduce``, ``fsdp`` and
``--mesh``, the pipeline's replicas and tied weights) call it once per step. docs/strategies.md,
"Parameters without a gradient", says what each strategy does.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist


def used_anywhere(local: Sequence[bool], device: torch.device, group: Optional[Any] = None) -> list[bool]:
    """For each parameter, whether some rank of ``group`` (default: all) gave it a gradient this
    step, given this rank's ``local`` answers (every rank of the group must call it, with as many)."""
    if not local:
        return []
    if not torch_dist.is_initialized() or torch_dist.get_world_size(group) == 1:
        return list(local)
    counts = torch.tensor([1.0 if used else 0.0 for used in local], device=device)
    torch_dist.all_reduce(counts, op=torch_dist.ReduceOp.SUM, group=group)
    return (counts > 0).tolist()


def names_of(names: Sequence[str], limit: int = 6) -> str:
    """Parameter names for a one-line message: the first ``limit``, then how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
