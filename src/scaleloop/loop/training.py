"""A run's life: ``train`` builds the run, restores a checkpoint if there is one, claims the run
directory and hands them to the :class:`~scaleloop.loop.trainer.Trainer`, whose loop trains it.

The loop is ``loop.trainer``; the step it takes is ``loop.step``; the evaluations and
checkpoints it pauses for are ``loop.pauses``; what a finished run reports is ``loop.result``.
Everything that differs between 1 and N workers is the strategy's (``scaleloop.strategies``).

A run in one of several replica groups (``--replica-groups N``): its meeting with the other groups
before the first step, and what a group that rejoined reports.

The strategy is ``strategies.fault_tolerant``'s (DDP in the group, torchft between groups). Joining
comes after a checkpoint is restored and before the loop starts: a group that is behind the others
(restarted after a fault, or without their newest checkpoint) takes a live group's weights,
optimizer state, schedule and place in the data, and its loop starts from that place as from a
checkpoint. docs/fault-tolerance.md.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from scaleloop.checkpoint.claim import claim_run_dir
from scaleloop.checkpoint.manager import Checkpointer, Progress, Resumed
from scaleloop.checkpoint.resume import run_dir_for
from scaleloop.config import TrainConfig, to_toml
from scaleloop.data.loader import Batch
from scaleloop.data.streaming import StreamingLoader
from scaleloop.loop.build import Run, build_run
from scaleloop.loop.pauses import record_ending
from scaleloop.loop.result import RunResult, RunningLoss
from scaleloop.loop.text import Log
from scaleloop.loop.trainer import Trainer
from scaleloop.output.footprint import reset_peak
from scaleloop.output.rundir import LOGS_DIR, refuse_if_in_use, write_atomic
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.collector import collection_paused
from scaleloop.runtime.dist import DistEnv, launched_by_torchrun, restart_count
from scaleloop.runtime.frames import note_where
from scaleloop.runtime.recovery import Recovery, last_worker_exit, take_faults
from scaleloop.runtime.startwatch import startup_watch
from scaleloop.strategies.fault_tolerant import FaultTolerant


__all__ = ["train", "RunResult", "STARTING_UP"]

STARTING_UP = "starting up (reading the data, building the model, its strategy and its optimizer)"


def train(cfg: TrainConfig, env: DistEnv, log: Optional[Log] = None,
          on_batch: Optional[Callable[[Batch], None]] = None,
          on_checkpoint: Optional[Callable[[Optional[Path], RunResult], None]] = None) -> RunResult:
    """Run the training that ``cfg`` describes on ``env``; rank 0 writes the run directory.

    ``on_batch`` (optional) sees every micro-batch this rank trains on, before its forward pass.
    ``on_checkpoint`` (optional) is called on every rank after each checkpoint is written, with
    its directory (on rank 0; None on the others) and the result so far (``scaleloop.ray`` hands
    them to Ray Train this way).
    """
    started, joined = time.perf_counter(), time.time()   # (called once the process group is formed)
    say: Log = (log or print) if env.is_main else (lambda _msg: None)
    reset_peak(env.device)  # this run's peak CUDA memory, not an earlier run's in this process
    if env.is_main:
        refuse_if_in_use(run_dir_for(cfg))   # before its checkpoints are read: "in use" is the reason
    try:
        # A slow step says so (startup_watch); the garbage collector waits (runtime.collector says why).
        with startup_watch(say) if env.is_main else contextlib.nullcontext(), collection_paused():
            run = build_run(cfg, env)
            checkpointer = Checkpointer(run.strategy, cfg.checkpointing, cfg.flat(), seed=cfg.optim.seed, say=say)
            resumed = checkpointer.restore(run.model, run.optimizer, run.scheduler, restarting=restart_count() > 0)
            resumed = join_replica_groups(run, resumed)   # --replica-groups: behind the others, take a live one's state
            _stream_state(run, checkpointer, resumed)
    except BaseException as exc:   # for the launcher's report: before any step
        note_where(exc, epoch=None, step=0, during=STARTING_UP)
        raise
    run_dir, lock = _open_run_dir(run, checkpointer, resumed)
    recovery = _recovery(cfg, env, joined, resumed)
    attach_replica_groups(run, run_dir, say, recovery, resumed)
    with lock:  # released at the end, however the run ends
        trainer = Trainer(run, checkpointer, say, started, run_dir=run_dir, resumed=resumed, on_batch=on_batch,
                          on_checkpoint=on_checkpoint)
        try:
            return trainer.fit(recovery)
        except BaseException as exc:
            record_ending(run_dir, exc, trainer.progress.global_step)  # for scaleloop doctor, while the lock is held
            raise


def _stream_state(run: Run, checkpointer: Checkpointer, resumed: Optional[Resumed]) -> None:
    """A stateful stream's place is saved with each checkpoint and loaded on resume (no re-read)."""
    if isinstance(run.loader, StreamingLoader):
        checkpointer.data_state = run.loader.state_dict
        if resumed is not None:
            run.loader.load_state_dict(resumed.data)


def _recovery(cfg: TrainConfig, env: DistEnv, joined: float, resumed: Optional[Resumed]) -> Optional[Recovery]:
    """On rank 0 of a group that torchrun restarted after a fault: what the attempt before left
    (every machine's records, a collective), to report once the first step is done."""
    if not launched_by_torchrun() or (env.world_size == 1 and restart_count() == 0):
        return None
    mine = take_faults(Path(cfg.checkpointing.out) / LOGS_DIR) if env.local_rank == 0 and cfg.checkpointing.out else []
    records = [r for rank_records in gather_object(mine, env) for r in rank_records]
    if not env.is_main:
        return None
    died = last_worker_exit(Path(cfg.checkpointing.out) / LOGS_DIR) if cfg.checkpointing.out and cfg.launch.nnodes == 1 else None
    found = Recovery.from_records(records, env.world_size, joined, restart=restart_count(),
                                  max_restarts=cfg.launch.max_restarts, died=died)
    if found is not None and resumed is not None:
        found.resumed_step = resumed.progress.global_step
    return found


def _open_run_dir(run: Run, checkpointer: Checkpointer, resumed: Optional[Resumed]
                  ) -> tuple[Optional[Path], contextlib.AbstractContextManager]:
    """Rank 0 owns the run directory: claims it (``scaleloop.checkpoint.claim``: or joins its
    launcher's claim) and writes ``config.toml``.

    Returns the directory (None on the other ranks) and its lock: this process's own, or shared
    with the launcher that holds it for its workers (``scaleloop.output.lock``).
    """
    run_dir, lock = None, contextlib.nullcontext()
    if run.env.is_main:
        # Only one of this run directory's own checkpoints continues the run in it; another
        # run's checkpoint starts a new run (a fork), which must not overwrite a run in --out.
        claim = claim_run_dir(run_dir_for(run.cfg), run.cfg.model_data.model, run.cfg.model_data.data,
                              source=resumed.source if resumed is not None else None,
                              restarting=restart_count() > 0,
                              from_copy=resumed is not None and resumed.copy_on_rank is not None,
                              nnodes=run.cfg.launch.nnodes)
        run_dir, lock = claim.path, claim.lock
        try:
            write_atomic(run_dir / "config.toml", to_toml(run.cfg).encode())
        except BaseException:
            lock.release()
            raise
    checkpointer.attach(run_dir)
    if resumed is not None:
        # Later checkpoints belong to the run before a rewind, or were skipped as damaged: they
        # must not count as the newest for a restart, for --resume auto, or for pruning.
        for moved in checkpointer.retire_after(resumed.progress.global_step):
            checkpointer.say(f"note: moved {moved.name} aside: it is later than the checkpoint this run "
                             "continues from")
    return run_dir, lock


# --- replica groups: meeting the others before the first step -------------------------------------

def join_replica_groups(run: Run, resumed: Optional[Resumed]) -> Optional[Resumed]:
    """Meet the other replica groups; what the loop continues from: a live group's place when this
    group took its state, else ``resumed`` (a checkpoint's, or None)."""
    strategy = run.strategy
    if not isinstance(strategy, FaultTolerant):
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
    if not isinstance(strategy, FaultTolerant):
        return
    strategy.attach(run_dir, say)
    if recovery is not None:
        recovery.replica_group = strategy.group.index
        recovery.rejoined_step = (resumed.progress.global_step + 1) if resumed is not None else 1
        since = strategy.left_since
        # No step trained by fewer groups (it came back before the others went on without it): it
        # left after the step before the one it rejoined at.
        recovery.left_after_step = (since if since is not None else recovery.rejoined_step) - 1
