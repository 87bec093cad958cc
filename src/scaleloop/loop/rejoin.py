"""A run in one of several replica groups (``--replica-groups N``): its meeting with the other groups
before the first step, and what a group that rejoined reports.

The strategy is ``strategies.fault_tolerant``'s (DDP in the group, torchft between groups). Joining
comes after a checkpoint is restored and before the loop starts: a group that is behind the others
(restarted after a fault, or without their newest checkpoint) takes a live group's weights,
optimizer state, schedule and place in the data, and its loop starts from that place as from a
checkpoint. docs/fault-tolerance.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from scaleloop.checkpoint.manager import Progress, Resumed
from scaleloop.loop.build import Run
from scaleloop.loop.running_loss import RunningLoss
from scaleloop.loop.text import Log
from scaleloop.runtime.recovery import Recovery
from scaleloop.strategies.fault_tolerant import FaultTolerantDDP


def join_replica_groups(run: Run, resumed: Optional[Resumed]) -> Optional[Resumed]:
    """Meet the other replica groups; what the loop continues from: a live group's place when this
    group took its state, else ``resumed`` (a checkpoint's, or None)."""
    strategy = run.strategy
    if not isinstance(strategy, FaultTolerantDDP):
        return resumed
    at = resumed.progress if resumed is not None else Progress()
    taken = strategy.join(run.model, run.optimizer, run.scheduler, at)
    if taken is None or taken.global_step == at.global_step:
        return resumed
    group = strategy.group
    # The loss sums of a log window are the group's own: the rejoining group starts a new one.
    return Resumed(source=Path(f"replica group {group.index}: a live group's state"), progress=taken,
                   sums=torch.zeros_like(RunningLoss().state(run.env.device)), saved_world_size=run.env.world_size,
                   notes=[f"note: replica group {group.index} took the weights, optimizer state and place of a live "
                          f"group at step {taken.global_step} (it was at step {at.global_step})"])


def attach_replica_groups(run: Run, run_dir: Optional[Path], say: Log, recovery: Optional[Recovery],
                          resumed: Optional[Resumed]) -> None:
    """Tell the strategy where to record short steps; name the group in a restarted group's recovery."""
    strategy = run.strategy
    if not isinstance(strategy, FaultTolerantDDP):
        return
    strategy.attach(run_dir, say)
    if recovery is not None:
        recovery.replica_group = strategy.group.index
        recovery.rejoined_step = (resumed.progress.global_step + 1) if resumed is not None else 1
        since = strategy.left_since
        # No step trained by fewer groups (it came back before the others went on without it): it
        # left after the step before the one it rejoined at.
        recovery.left_after_step = (since if since is not None else recovery.rejoined_step) - 1
