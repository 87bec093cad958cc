"""Stopping on a preemption signal at an optimizer step's end, on every rank at the same step.

A signal reaches the ranks at different moments (or only some of them), so no rank may stop on
its own: the others would wait for it in the next collective. So the ranks vote: at a step's end
every rank all-reduces (MAX) "I received a stop signal" together with the seconds since the last
vote, and all stop after that same step if any rank received one. A vote every step would cost a
small step a visible share of its time, so the votes come about every ``VOTE_INTERVAL_S``
seconds: the interval in steps is set from the reduced seconds, which every rank gets alike, so
every rank votes after the same steps. The run stops within about that interval of the signal.

Then the loop ends the epoch as ``--max-steps`` does (a stop row, one checkpoint written by every
rank together) and :meth:`StopVote.preempted` gives the exception that ends the process with the
line saying how to continue. The signals themselves: ``scaleloop.runtime.preempt``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from scaleloop.checkpoint.store import CHECKPOINTS_DIR, step_dir_name
from scaleloop.runtime import preempt
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.slurm import in_slurm_job, requeue


# About this often (by the slowest rank's clock) the ranks vote: a one-element all-reduce every
# step cost a 2 ms step (Gloo, 2 CPU processes) half a millisecond; every half second it is lost
# in the noise, and the stop comes at most about half a second later.
VOTE_INTERVAL_S = 0.5
MAX_STEPS_BETWEEN_VOTES = 1000


class StopVote:
    """Whether every rank should stop after the step just taken; one per training loop."""

    def __init__(self, env: DistEnv, named_signal: Optional[str], *, torchrun_worker: bool) -> None:
        self.env = env
        self.stopped_after: Optional[int] = None
        self._every = 1          # steps between votes, the same on every rank (set from reduced values)
        self._countdown = 1
        self._since = time.perf_counter()
        # NCCL reduces device tensors only; Gloo a CPU one.
        self._device = env.device if env.is_distributed and env.backend == "nccl" else torch.device("cpu")
        slurm = in_slurm_job(os.environ)
        preempt.listen(preempt.stop_signals(named_signal, torchrun_worker=torchrun_worker, slurm=slurm))

    def after_step(self, step: int) -> bool:
        """Call on every rank after each optimizer step; True when all ranks stop after ``step``."""
        if not self.env.is_distributed:   # one process has no one to vote with: its own signal decides
            return self._after_step_alone(step)
        self._countdown -= 1
        if self._countdown > 0:
            return False
        if self._vote():
            self.stopped_after = step
            return True
        return False

    def _after_step_alone(self, step: int) -> bool:
        """:meth:`after_step` of a single process: stop after the step a signal arrived in."""
        if preempt.requested() is None:
            return False
        self.stopped_after = step
        return True

    def _vote(self) -> bool:
        """One all-reduce (MAX) of [stop requested, seconds since the last vote]; every rank gets the
        same two numbers, so every rank also sets the same number of steps to the next vote."""
        values = torch.tensor([1.0 if preempt.requested() is not None else 0.0, time.perf_counter() - self._since],
                              dtype=torch.float64, device=self._device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        stop, elapsed = values.tolist()
        per_step = max(elapsed / self._every, 1e-6)
        self._every = self._countdown = max(1, min(MAX_STEPS_BETWEEN_VOTES, int(VOTE_INTERVAL_S / per_step)))
        self._since = time.perf_counter()
        return stop > 0

    def preempted(self, run_dir: Optional[Path], checkpoint_step: Optional[int], *, checkpoints: bool = True,
                  machines: int = 1, requeue_job: bool = False) -> preempt.Preempted:
        """The exception that ends the run, with its one line; rank 0 first asks SLURM to requeue
        the job if ``requeue_job`` (``--requeue``) says so (the checkpoint is complete by now: saving is
        collective). ``checkpoints``: whether the run writes any; ``machines``: ``--nnodes``."""
        received = preempt.requested()
        why = f"stopped by {preempt.signal_name(received)}" if received is not None else "stopped on request"
        if not checkpoints or checkpoint_step is None:
            text = (f"{why} after step {self.stopped_after}; no checkpoint was written (--no-checkpoints): "
                    "a new run starts over")
        else:
            checkpoint = Path(run_dir or ".") / CHECKPOINTS_DIR / step_dir_name(checkpoint_step)
            where = " (on every machine, with its own --node-rank)" if machines > 1 else ""
            text = (f"{why} after step {self.stopped_after}; checkpoint {checkpoint} written; "
                    f"continue with: {preempt.continue_command(str(run_dir))}{where}")
        if requeue_job and self.env.is_main:
            text += "; " + requeue(os.environ)
        return preempt.Preempted(text)
