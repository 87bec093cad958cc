"""Where training pauses: the evaluations and the checkpoints, inside an epoch and at its end.

The trainer (``loop.trainer``) calls :meth:`Pauses.inside` after a step that is due for one
(``--eval-every``, ``--checkpoint-every``) and :meth:`Pauses.end_epoch` at each epoch's end.
Neither draws the training's random numbers, so a run trains exactly as it would without them;
their time is not training time (the caller takes it out of samples/s).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from scaleloop.checkpoint.manager import Checkpointer, Progress
from scaleloop.loop.build import Run
from scaleloop.loop.evaluate import EvalResult
from scaleloop.loop.evaluations import Evaluations
from scaleloop.loop.health import Row, reduce_checked, stopped_on_nonfinite
from scaleloop.loop.result import RunResult
from scaleloop.loop.running_loss import RunningLoss
from scaleloop.loop.text import Log, describe_evals
from scaleloop.output.metrics import MetricsLogger
from scaleloop.runtime.devices import device_clock


class Pauses:
    """The evaluations and checkpoints of one run, and what it is doing while paused."""

    def __init__(self, run: Run, result: RunResult, running: RunningLoss, checkpointer: Checkpointer,
                 emit: Callable[[Row], None], metrics: Optional[MetricsLogger], say: Log) -> None:
        self.run, self.result, self.running, self.checkpointer = run, result, running, checkpointer
        self.emit, self.metrics, self.say = emit, metrics, say   # emit: the trainer's, which writes and checks a row
        self.evals = Evaluations(run.model, run.cfg.evaluation, run.data, run.strategy,
                                 batch_size=run.cfg.batch_size, seed=run.cfg.seed,
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
        return bool((cfg.eval_every and done_steps % cfg.eval_every == 0)
                    or (cfg.checkpoint_every and done_steps % cfg.checkpoint_every == 0))

    def inside(self, epoch: int, in_epoch: int, done_steps: int, epoch_start: float) -> float:
        """The evaluation and the checkpoint due after step ``done_steps`` inside an epoch (not at its
        end, where :meth:`end_epoch` does both); returns the seconds they took. The evaluation comes
        first: a run resumed from the checkpoint goes on to the next multiple."""
        cfg, paused = self.run.cfg, 0.0
        if cfg.eval_every and done_steps % cfg.eval_every == 0:
            paused += self._eval_inside(epoch)
        if cfg.checkpoint_every and done_steps % cfg.checkpoint_every == 0:
            train_s = self.result.train_s + time.perf_counter() - (epoch_start + paused)
            paused += self._checkpoint(Progress(epoch, in_epoch), train_s)
        return paused

    def end_epoch(self, epoch: int, in_epoch: int, finished: bool) -> None:
        """The epoch's global loss, the test set, the epoch's row and line, and a checkpoint.

        Where the run stopped inside the epoch (``finished`` False: ``--max-steps``, a stop vote),
        the row is a ``stop`` row: the run that resumes it writes the epoch's row, once.
        """
        run, result = self.run, self.result
        result.epochs = epoch + 1
        total = self.check_finite(epoch, self.running.epoch_sums(torch.device("cpu")).tolist())
        result.train_loss = total[0] / total[1] if total[1] > 0 else float("nan")
        result.train_loss_over = (f"epoch {epoch + 1}{'' if finished else ' so far'}, "
                                  f"steps {result.steps - in_epoch + 1}-{result.steps}")
        self.doing = f"the evaluation after epoch {epoch + 1}"
        test = result.test = self.evals.test()
        train = self._eval_train()
        self.doing = None
        if self.evals.due(result.steps) and result.eval_row_step != result.steps:
            self._emit_eval(epoch, test, train)   # the step's --eval-every row, from the same evaluation
        skipped = self.skipped()
        self.emit(Row("epoch" if finished else "stop", epoch + 1, result.steps, result.samples, dict(
            train_loss=result.train_loss, test_loss=test.loss if test else None,
            test_acc=test.accuracy if test else None, lr=result.step_lr,
            samples_per_s=result.samples / max(result.train_s, 1e-9), wall_s=time.perf_counter() - result.started,
            skipped_steps=skipped if run.strategy.precision.skipped is not None else None,
            train_eval_loss=train.loss if train else None)))
        self.say(f"epoch {epoch + 1}: train loss {result.train_loss:.4f}"
                 + "".join(f", {part}" for part in describe_evals(test, train)))
        # At the epoch's end (or where the run stopped inside it): the next run starts after it.
        self.doing = f"writing the checkpoint of step {result.steps}"
        self._save(Progress(epoch + 1 if finished else epoch, 0 if finished else in_epoch,
                            result.steps, result.samples, result.train_s, skipped))
        self.doing = None

    def check_finite(self, epoch: int, head: list[float]) -> list[float]:
        """``head`` summed over ranks; raises :class:`~scaleloop.loop.health.Diverged` (or names the
        data) on every rank alike if a loss so far or the weights are not finite, before a
        checkpoint could hold them."""
        env = self.run.env
        sums, first, ranks = reduce_checked(env, self.run.model, head, self.running.first_nonfinite_step())
        if first is not None or ranks:
            what = ("the training loss became non-finite" if first is not None
                    else "the weights were no longer finite (inf or NaN) after")
            raise stopped_on_nonfinite(what, first or self.result.steps, epoch + 1, self.result.out,
                                       self.checkpointer.last_step, ranks, env.world_size, self.run.loader)
        return sums

    def skipped(self) -> int:
        """fp16 steps the scaler skipped, this process's and before it (reads the device)."""
        return self.result.skipped_before + self.run.strategy.precision.skipped_steps()

    def _checkpoint(self, where: Progress, train_s: float) -> float:
        """A checkpoint inside an epoch (``where``: epoch and step in it); returns the seconds it took."""
        run, result = self.run, self.result
        pause = device_clock(run.env.device)  # queued steps are training time, not the checkpoint's
        if self.metrics is not None:
            self.metrics.flush()   # the rows up to the checkpoint, on disk with it
        if run.cfg.checkpoints:   # one small all-reduce per checkpoint: no checkpoint of a diverged run
            self.check_finite(where.epoch, [])
        self.doing = f"writing the checkpoint of step {result.steps}"
        self._save(Progress(where.epoch, where.step_in_epoch, result.steps, result.samples, train_s, self.skipped()))
        self.doing = None
        return time.perf_counter() - pause

    def _save(self, progress: Progress) -> None:
        """Write the checkpoint of ``progress`` and hand it to ``on_checkpoint`` (when one was written:
        ``written`` counts on every rank alike, the path is known on the writing rank only).

        With ``--async-checkpoint`` the write in flight is completed first, and this one goes on in
        the background; a run that hands its checkpoints on waits for it at once (it hands on whole ones)."""
        run, written = self.run, self.checkpointer.written
        progress.window_from = self.result.window_from   # where the log window in the saved sums began
        doing, self.doing = self.doing, None
        self.finish_write()
        self.doing = doing
        path = self.checkpointer.save(run.model, run.optimizer, run.scheduler, progress,
                                      self.running.state(run.env.device))
        if self.on_checkpoint is not None:
            path = self.finish_write() or path
            if self.checkpointer.written > written:
                self.on_checkpoint(path, self.result)

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
        self.doing = f"the evaluation at step {self.result.steps}"
        test = self.evals.test(isolated=True)
        train = self._eval_train()
        self.doing = None
        self._emit_eval(epoch, test, train)
        return time.perf_counter() - pause

    def _eval_train(self) -> Optional[EvalResult]:
        """With ``--eval-train``: the training loss in evaluation mode, kept for the summary."""
        train = self.evals.train()
        if train is not None:
            self.result.train_eval, self.result.train_eval_step = train, self.result.steps
        return train

    def _emit_eval(self, epoch: int, test: Optional[EvalResult], train: Optional[EvalResult]) -> None:
        """The ``eval`` row of an evaluation at this step, and its line."""
        result = self.result
        result.eval_row_step = result.steps
        self.emit(Row("eval", epoch + 1, result.steps, result.samples, dict(
            test_loss=test.loss if test else None, test_acc=test.accuracy if test else None,
            train_eval_loss=train.loss if train else None, wall_s=time.perf_counter() - result.started)))
        self.say(f"step {result.steps}: " + ", ".join(describe_evals(test, train)))
