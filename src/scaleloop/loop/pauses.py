"""Where training pauses, and where it stops: the evaluations and checkpoints, the stop vote
(``StopVote``) and the record of an ending (``record_ending``).

Where training pauses: the evaluations and the checkpoints, inside an epoch and at its end.

The trainer (``loop.trainer``) calls :meth:`Pauses.inside` after a step that is due for one
(``--eval-every``, ``--checkpoint-every``) and :meth:`Pauses.end_epoch` at each epoch's end.
Neither draws the training's random numbers, so a run trains exactly as it would without them;
their time is not training time (the caller takes it out of samples/s).

Stopping on a preemption signal at an optimizer step's end, on every rank at the same step.

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

The record of an ending the loop decides itself, on rank 0, while it still holds the run
directory: a non-finite loss, a stop signal, a file it cannot write, bad input found while
training, Ctrl-C. (A failed or stalled rank is recorded by the launcher, which sees every rank.)
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from scaleloop.checkpoint.manager import Checkpointer, Progress
from scaleloop.checkpoint.store import CHECKPOINTS_DIR, step_dir_name
from scaleloop.errors import UsageError
from scaleloop.loop.build import Run
from scaleloop.loop.evaluation import EvalResult, Evaluations
from scaleloop.loop.result import RunResult, RunningLoss
from scaleloop.loop.rows import Diverged, Row, reduce_checked, stopped_on_nonfinite
from scaleloop.loop.text import Log, describe_evals
from scaleloop.output.endings import Failure
from scaleloop.output.metrics import MetricsLogger
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime import preempt
from scaleloop.runtime.devices import device_clock
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.frames import where_of
from scaleloop.runtime.preempt import Preempted
from scaleloop.runtime.slurm import in_slurm_job, requeue


class Pauses:
    """The evaluations and checkpoints of one run, and what it is doing while paused.

    It reads where the run stands from the trainer's ``progress`` (and ``start``, where this
    process began), writes the losses and evaluations into its ``result``; ``started`` is
    ``perf_counter()`` when the process group formed, ``out`` the run directory as every rank knows it."""

    def __init__(self, run: Run, result: RunResult, progress: Progress, running: RunningLoss,
                 checkpointer: Checkpointer, emit: Callable[[Row], None], metrics: Optional[MetricsLogger], say: Log,
                 *, started: float, start: Progress, out: Path) -> None:
        self.run, self.result, self.progress, self.running, self.checkpointer = run, result, progress, running, checkpointer
        self.emit, self.metrics, self.say = emit, metrics, say   # emit: the trainer's, which writes and checks a row
        self.started, self.start, self.out = started, start, out
        self.eval_row_step = -1   # the step of the last ``eval`` row (one per step at most)
        self.evals = Evaluations(run.model, run.cfg.evaluation, run.data, run.strategy,
                                 batch_size=run.cfg.optim.batch_size, seed=run.cfg.optim.seed,
                                 loss_fn=run.loss_fn if run.user_loss else None,
                                 keep_target=run.loader.keep_target, metrics=run.metrics)
        #: What the loop does when not a training step (an evaluation, a checkpoint), for the report.
        self.doing: Optional[str] = None
        #: Called on every rank after each checkpoint written, with its path (on the writing rank; None
        #: on the others) and the result so far: how a run hands its checkpoints on (``scaleloop.ray``).
        self.on_checkpoint: Optional[Callable[[Optional[Path], RunResult], None]] = None

    def due(self, done_steps: int) -> bool:
        """Whether an evaluation or a checkpoint is due after step ``done_steps``."""
        cfg = self.run.cfg
        return bool((cfg.evaluation.eval_every and done_steps % cfg.evaluation.eval_every == 0)
                    or (cfg.checkpointing.checkpoint_every and done_steps % cfg.checkpointing.checkpoint_every == 0))

    def inside(self, epoch: int, in_epoch: int, done_steps: int, epoch_start: float) -> float:
        """The evaluation and the checkpoint due after step ``done_steps`` inside an epoch (not at its
        end, where :meth:`end_epoch` does both); returns the seconds they took. The evaluation comes
        first: a run resumed from the checkpoint goes on to the next multiple."""
        cfg, paused = self.run.cfg, 0.0
        if cfg.evaluation.eval_every and done_steps % cfg.evaluation.eval_every == 0:
            paused += self._eval_inside(epoch)
        if cfg.checkpointing.checkpoint_every and done_steps % cfg.checkpointing.checkpoint_every == 0:
            train_s = self.progress.train_s + time.perf_counter() - (epoch_start + paused)
            paused += self._checkpoint(epoch, train_s)
        return paused

    def end_epoch(self, epoch: int, in_epoch: int, finished: bool, lr: float) -> None:
        """The epoch's global loss, the test set, the epoch's row and line, and a checkpoint.

        Where the run stopped inside the epoch (``finished`` False: ``--max-steps``, a stop vote),
        the row is a ``stop`` row: the run that resumes it writes the epoch's row, once. ``lr``: the
        learning rate of its last step.
        """
        run, result, progress = self.run, self.result, self.progress
        result.epochs = epoch + 1
        if finished:   # the next step is the next epoch's first
            progress.epoch, progress.step_in_epoch = epoch + 1, 0
        total = self.check_finite(epoch, self.running.epoch_sums(torch.device("cpu")).tolist())
        result.train_loss = total[0] / total[1] if total[1] > 0 else float("nan")
        result.train_loss_over = (f"epoch {epoch + 1}{'' if finished else ' so far'}, "
                                  f"steps {progress.global_step - in_epoch + 1}-{progress.global_step}")
        self.doing = f"the evaluation after epoch {epoch + 1}"
        test = result.test = self.evals.of_test_set()
        train = self._eval_train()
        self.doing = None
        if self.evals.due(progress.global_step) and self.eval_row_step != progress.global_step:
            self._emit_eval(epoch, test, train)   # the step's --eval-every row, from the same evaluation
        skipped = self.skipped()
        self.emit(Row("epoch" if finished else "stop", epoch + 1, progress.global_step, progress.samples, dict(
            train_loss=result.train_loss, test_loss=test.loss if test else None,
            test_acc=test.accuracy if test else None, lr=lr,
            samples_per_s=progress.samples / max(progress.train_s, 1e-9), wall_s=time.perf_counter() - self.started,
            skipped_steps=skipped if run.strategy.precision.skipped is not None else None,
            train_eval_loss=train.loss if train else None)))
        self.say(f"epoch {epoch + 1}: train loss {result.train_loss:.4f}"
                 + "".join(f", {part}" for part in describe_evals(test, train)))
        # At the epoch's end (or where the run stopped inside it): the next run starts after it.
        self.doing = f"writing the checkpoint of step {progress.global_step}"
        self._save(replace(progress, skipped_steps=skipped))
        self.doing = None

    def check_finite(self, epoch: int, head: list[float]) -> list[float]:
        """``head`` summed over ranks; raises :class:`~scaleloop.loop.rows.Diverged` (or names the
        data) on every rank alike if a loss so far or the weights are not finite, before a
        checkpoint could hold them."""
        env = self.run.env
        sums, first, ranks = reduce_checked(env, self.run.model, head, self.running.first_nonfinite_step())
        if first is not None or ranks:
            what = ("the training loss became non-finite" if first is not None
                    else "the weights were no longer finite (inf or NaN) after")
            raise stopped_on_nonfinite(what, first or self.progress.global_step, epoch + 1, self.out,
                                       self.checkpointer.last_step, ranks, env.world_size, self.run.loader)
        return sums

    def skipped(self) -> int:
        """fp16 steps the scaler skipped, this process's and before it (reads the device)."""
        return self.start.skipped_steps + self.run.strategy.precision.skipped_steps()

    def _checkpoint(self, epoch: int, train_s: float) -> float:
        """A checkpoint inside epoch ``epoch``, with ``train_s`` seconds trained; returns the seconds it took."""
        run, progress = self.run, self.progress
        pause = device_clock(run.env.device)  # queued steps are training time, not the checkpoint's
        if self.metrics is not None:
            self.metrics.flush()   # the rows up to the checkpoint, on disk with it
        if run.cfg.checkpointing.checkpoints:   # one small all-reduce per checkpoint: no checkpoint of a diverged run
            self.check_finite(epoch, [])
        self.doing = f"writing the checkpoint of step {progress.global_step}"
        self._save(replace(progress, train_s=train_s, skipped_steps=self.skipped()))
        self.doing = None
        return time.perf_counter() - pause

    def _save(self, progress: Progress) -> None:
        """Write the checkpoint of ``progress`` (a copy of where the run stands) and hand it to
        ``on_checkpoint`` (when one was written: ``written`` counts on every rank alike, the path is
        known on the writing rank only).

        With ``--async-checkpoint`` the write in flight is completed first, and this one goes on in
        the background; a run that hands its checkpoints on waits for it at once (it hands on whole ones)."""
        run, written = self.run, self.checkpointer.written
        doing, self.doing = self.doing, None
        self.finish_write()
        self.doing = doing
        path = self.checkpointer.save(run.model, run.optimizer, run.scheduler, progress,
                                      self.running.state(run.env.device))
        if self.on_checkpoint is not None:
            path = self.finish_write() or path
            if self.checkpointer.written > written:
                self.on_checkpoint(path, self.result.counted(progress))   # the counts this checkpoint holds

    def finish_write(self) -> Optional[Path]:
        """Complete the checkpoint being written in the background, if any (every rank at the same
        point: the next checkpoint, the run's end, a stop); a failed write is raised here, named as
        what the loop was doing. Returns its path (on the writing rank)."""
        step = self.checkpointer.pending_step
        if step is None:
            return None
        self.doing = f"writing the checkpoint of step {step}"
        path = self.checkpointer.wait()
        self.doing = None
        return path

    def _eval_inside(self, epoch: int) -> float:
        """The evaluation at this step inside epoch ``epoch`` (every ``--eval-every`` steps): its
        row and line; returns the seconds it took."""
        pause = device_clock(self.run.env.device)  # queued steps are training time, not the evaluation's
        self.doing = f"the evaluation at step {self.progress.global_step}"
        test = self.evals.of_test_set(isolated=True)
        train = self._eval_train()
        self.doing = None
        self._emit_eval(epoch, test, train)
        return time.perf_counter() - pause

    def _eval_train(self) -> Optional[EvalResult]:
        """With ``--eval-train``: the training loss in evaluation mode, kept for the summary."""
        train = self.evals.of_training_set()
        if train is not None:
            self.result.train_eval, self.result.train_eval_step = train, self.progress.global_step
        return train

    def _emit_eval(self, epoch: int, test: Optional[EvalResult], train: Optional[EvalResult]) -> None:
        """The ``eval`` row of an evaluation at this step, and its line."""
        progress = self.progress
        self.eval_row_step = progress.global_step
        self.emit(Row("eval", epoch + 1, progress.global_step, progress.samples, dict(
            test_loss=test.loss if test else None, test_acc=test.accuracy if test else None,
            train_eval_loss=train.loss if train else None, wall_s=time.perf_counter() - self.started)))
        self.say(f"step {progress.global_step}: " + ", ".join(describe_evals(test, train)))


# --- stopping on a preemption signal, every rank at the same step ---------------------------------

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


# --- the record of an ending the loop decides -----------------------------------------------------

def record_ending(run_dir: Optional[Path], exc: BaseException, step: int) -> None:
    """Write ``run_dir/failure.json`` for ``exc`` when it is one of the loop's own endings (see the
    module doc); nothing for another exception, or on a rank without the run directory.
    ``step``: the last global step trained."""
    if run_dir is None:
        return
    where = where_of(exc)
    if isinstance(exc, Diverged):
        record = Failure("diverged", exc.ranks[0] if len(exc.ranks) == 1 else None, exc.epoch, exc.step,
                         message=exc.what)
    elif isinstance(exc, Preempted):
        record = Failure("stopped", step=step, message=str(exc))
    elif isinstance(exc, RunDirWriteError):
        record = Failure("unwritable", epoch=where["epoch"], step=where["step"], message=str(exc),
                         during=where["during"])
    elif isinstance(exc, UsageError):
        record = Failure("usage", epoch=where["epoch"], step=where["step"], message=str(exc), during=where["during"])
    elif isinstance(exc, KeyboardInterrupt):
        record = Failure("interrupted", step=step, message="Ctrl-C (SIGINT) or SIGTERM")
    else:
        return
    record.error_type = type(exc).__name__
    record.report = [f"scaleloop: {record.message}"]
    record.write(run_dir)
