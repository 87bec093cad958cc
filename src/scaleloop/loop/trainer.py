"""The loop behind ``scaleloop train``: epochs of steps, a log row every ``--log-every`` steps.

Read :meth:`Trainer.train_epoch` top to bottom: for every step of the epoch ``train_step``
(``loop.step``), then the step's counts, a log row when due, the stop checks (``--max-steps``,
a stop signal) and the pauses when due (``loop.pauses``: evaluations, checkpoints); at the
epoch's end the loss reduced over ranks, the test set, the epoch's row and a checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from scaleloop.checkpoint.manager import Checkpointer, Progress, Resumed
from scaleloop.checkpoint.resume import run_dir_for
from scaleloop.data.loader import Batch
from scaleloop.loop.build import Run
from scaleloop.loop.pauses import Pauses, StopVote
from scaleloop.loop.result import RunResult, RunningLoss, finish
from scaleloop.loop.rows import Row, Stragglers, check_health, reduce_window
from scaleloop.loop.step import Observer, steps_of, train_step
from scaleloop.loop.text import Log, announce, bar_postfix, nothing_left, progress_bar
from scaleloop.output.footprint import gradient_bytes
from scaleloop.output.metrics import MetricsLogger
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.devices import device_clock
from scaleloop.runtime.dist import launched_by_torchrun, restart_count
from scaleloop.runtime.frames import note_where
from scaleloop.runtime.recovery import RECOVERY_FILE, Recovery

if TYPE_CHECKING:
    from scaleloop.loop.profiler import Profiler


class Trainer(Observer):
    """One run's loop and what it carries from step to step: the run, its checkpointer, where it
    stands (``progress``: the :class:`~scaleloop.checkpoint.manager.Progress` a checkpoint saves), the
    running loss, the pauses, and the result it will report (:class:`~scaleloop.loop.result.RunResult`).

    It watches its own steps (an :class:`~scaleloop.loop.step.Observer`): the gradients' bytes at
    the first step (they exist only between the backward and the optimizer step), and with several
    ranks this rank's own seconds: its work (data, forward passes) up to its step's last loss, the
    part of a step that does not wait for the other ranks, so that the log rows can compare ranks
    (a straggler). One rank has no one to compare with: its clock is not read.

    ``on_batch`` (optional) sees every micro-batch this rank trains on, before its forward pass;
    ``on_checkpoint`` (optional) each checkpoint written (:attr:`Pauses.on_checkpoint`).
    Making one opens ``metrics.csv`` and the tracker (when ``run_dir`` is given) and nothing else:
    no line is said and no signal handler installed until :meth:`fit`.
    """

    def __init__(self, run: Run, checkpointer: Checkpointer, say: Log, started: float, *,
                 run_dir: Optional[Path] = None, resumed: Optional[Resumed] = None,
                 on_batch: Optional[Callable[[Batch], None]] = None,
                 on_checkpoint: Optional[Callable[[Optional[Path], RunResult], None]] = None) -> None:
        cfg = self.cfg = run.cfg
        self.run, self.env, self.checkpointer, self.say = run, run.env, checkpointer, say
        self.run_dir, self.resumed = run_dir, resumed
        #: Where the run started (a checkpoint's place, or the beginning) ...
        at = self.at = resumed.progress if resumed is not None else Progress()
        self.metrics: Optional[MetricsLogger] = (
            MetricsLogger(run_dir, tensorboard=cfg.output.tensorboard, tracker=cfg.output.tracker, config=cfg,
                          keep_until_step=at.global_step if resumed is not None or restart_count() > 0 else None)
            if run_dir is not None else None)
        #: ... and where it stands: the next step, the samples and training seconds so far, the step
        #: the log window began after. Its fp16 skipped steps are counted when read (Pauses.skipped).
        self.progress = replace(at, window_from=at.log_window_from(cfg.output.log_every))
        self.result = RunResult(run_dir=run_dir, epochs=at.epoch)
        self.started = started   # perf_counter() when the process group formed
        self.out = run_dir or run_dir_for(cfg)   # the run directory, as every rank knows it (for messages)
        self.stragglers = Stragglers()
        self.step_lr: float = run.optimizer.param_groups[0]["lr"]   # the learning rate of the last step
        self.running = RunningLoss()  # loss x samples and samples, of the epoch and of the log window
        if resumed is not None:
            self.running.load(resumed.sums)
        self.on_batch = on_batch
        self.clocked = run.env.world_size > 1
        self.gradient_bytes: Optional[int] = None
        self.own_s = 0.0   # since the last take_own_s
        #: The gradient norm of the step before the next log row (``train_step``'s, on the device).
        self.grad_norm: Optional[torch.Tensor] = None
        #: ``time.perf_counter()`` when the loop last moved on: the last step's end, or a restart.
        self.last_progress = self._loss_known = time.perf_counter()
        self.pauses = Pauses(run, self.result, self.progress, self.running, checkpointer, self.emit, self.metrics,
                             say, started=started, start=at, out=self.out)
        self.pauses.on_checkpoint = on_checkpoint
        self.recovery: Optional[Recovery] = None   # a fault's recovery, reported after the first step
        self.vote: Optional[StopVote] = None       # the preemption stop vote (loop/pauses.py), from fit on
        #: Who watches train_step: the trainer itself, or with --profile a profiler that passes each
        #: call on to it (``loop.profiler``; off, nothing of it is imported and nothing added per step).
        self.watch: Observer = self
        self.profiler: Optional["Profiler"] = None
        if cfg.output.profile:
            from scaleloop.loop.profiler import profiler_for
            self.profiler = profiler_for(self, run, self.out, say, start_step=at.global_step)
            self.watch = self.profiler

    def emit(self, row: Row) -> None:
        """Write ``row`` (rank 0: ``metrics.csv`` and the tracker), then check a log row's health on
        every rank: the row that shows a problem is on disk before the run stops on it."""
        if self.metrics is not None:
            self.metrics.write(row.kind, epoch=row.epoch, step=row.step, samples=row.samples, **row.values)
        if row.totals is not None:
            check_health(row, row.totals, self.stragglers, self.out, self.checkpointer, self.run.loader)

    def fit(self, recovery: Optional[Recovery] = None) -> RunResult:
        """The epochs from the checkpoint's place on; then the final weights and the result.

        ``recovery``: what the attempt before a fault left, reported after the first step.
        """
        cfg, result, at, progress = self.cfg, self.result, self.at, self.progress
        announce(self.run, self.resumed, self.say)
        evaluations = self.pauses.evals.describe()
        if evaluations is not None:
            self.say(evaluations)
        done = result.nothing_left = nothing_left(cfg, at, self.say)
        self.recovery = recovery
        vote = self.vote = StopVote(self.env, cfg.launch.signal, torchrun_worker=launched_by_torchrun())
        self.run.model.train()
        try:
            for epoch in range(at.epoch, cfg.optim.epochs):
                if done:
                    break
                done = self.train_epoch(epoch, at.step_in_epoch if epoch == at.epoch else 0)
            self.pauses.finish_write()   # the last checkpoint, if written in the background, is whole
            if vote.stopped_after is not None:  # the checkpoint is written: end with how to continue
                raise vote.preempted(self.out, self.checkpointer.last_step, checkpoints=cfg.checkpointing.checkpoints,
                                     machines=cfg.launch.nnodes, requeue_job=cfg.launch.requeue)
        except RunDirWriteError as exc:  # rank 0's own files (metrics.csv): add where the run can go on from
            self.checkpointer.wait_alone()
            note_where(exc, epoch=progress.epoch + 1, step=progress.global_step + 1, during=self.pauses.doing)
            raise exc.with_hint(self.checkpointer.continue_hint(exc.once)) from None
        except BaseException as exc:  # where the loop was, for the launcher's failure report
            if self.profiler is not None:   # the trace so far; a CUDA out-of-memory's snapshot
                self.profiler.abandon(exc)
            self.checkpointer.wait_alone()   # a background write in flight ends first (no collective)
            note_where(exc, epoch=progress.epoch + 1, step=progress.global_step + 1,
                       last_progress=time.time() - (time.perf_counter() - self.last_progress),
                       during=self.pauses.doing)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.close()
        if self.profiler is not None and not result.nothing_left:   # every rank's numbers to rank 0: the summary
            self.profiler.report()
        if result.test is None:
            result.test = self.pauses.evals.of_test_set()  # nothing trained: the checkpoint's model
        progress.skipped_steps = self.pauses.skipped()
        worst = self.stragglers.worst
        result.straggler = worst.describe() if worst is not None else ""
        return finish(self.run, result.counted(progress), self.checkpointer, self.resumed, self.gradient_bytes,
                      self.started)

    def train_epoch(self, epoch: int, first_step: int) -> bool:
        """Epoch ``epoch`` from its step ``first_step`` on, then its end; True when the run stops
        in it (``--max-steps``, or the stop vote)."""
        cfg, run, progress, pauses = self.cfg, self.run, self.progress, self.pauses
        sampler = run.loader.sampler
        progress.epoch, progress.step_in_epoch = epoch, first_step
        run.loader.set_epoch(epoch, first_step)
        if first_step == 0:
            self.running.new_epoch()
        in_epoch, done = first_step, False
        bar = progress_bar(sampler.steps_per_epoch, first_step, f"epoch {epoch + 1}/{cfg.optim.epochs}",
                           cfg.output.progress and self.env.is_main)
        # The clock waits for the GPU (device_clock): it runs behind the loop, and a time read
        # with steps still queued makes samples/s look better than it is. Free on the CPU.
        epoch_start = window_start = device_clock(self.env.device)
        window_samples = 0
        self.restart_clock()
        for micro_batches in steps_of(run.loader):
            self.step_lr = run.optimizer.param_groups[0]["lr"]   # the learning rate this step uses
            logs = (progress.global_step + 1) % cfg.output.log_every == 0   # a log row after this step: it shows the norm
            losses, grad_norm = train_step(run, micro_batches, self.watch, norm=logs)   # watched (below)
            progress.global_step += 1
            if grad_norm is not None:
                self.grad_norm = grad_norm
            for batch, loss in zip(micro_batches, losses):
                if loss is not None:  # None: this rank computes no loss (a pipeline's earlier stage)
                    self.running.add(loss, len(batch), progress.global_step)
            if self.recovery is not None:
                self._report_recovery(epoch)
            where = micro_batches[-1].place
            in_epoch = progress.step_in_epoch = where.step + 1
            progress.samples += where.step_samples
            window_samples += where.step_samples
            if bar is not None:
                bar.update(1)
            if progress.global_step % cfg.output.log_every == 0:
                window_start = self.log_row(epoch, window_samples, window_start, bar)
                window_samples = 0
            # Every rank ends at --max-steps, or where the stop vote says so (the same step on all).
            if ((cfg.optim.max_steps is not None and progress.global_step >= cfg.optim.max_steps)
                    or (self.vote is not None and self.vote.after_step(progress.global_step))):
                done = True
                break
            if pauses.due(progress.global_step) and not _epoch_complete(sampler, in_epoch):
                paused = pauses.inside(epoch, in_epoch, progress.global_step, epoch_start)
                self.restart_clock()
                epoch_start += paused   # not training time, as at the epoch's end
                window_start += paused
        progress.train_s += device_clock(self.env.device) - epoch_start
        if bar is not None:
            bar.close()
        pauses.end_epoch(epoch, in_epoch, finished=_epoch_complete(sampler, in_epoch), lr=self.step_lr)
        return done

    def log_row(self, epoch: int, window_samples: int, window_start: float, bar: Any = None) -> float:
        """The log row of the global loss since the last one (a collective), written and checked;
        returns the new window's start. ``window_samples`` trained since ``window_start``.

        The same all-reduce gathers each rank's own time, first non-finite step and fp16 skipped
        steps (``scaleloop.loop.rows``), which the health checks read (``loop.rows``).
        """
        run, result, progress, running = self.run, self.result, self.progress, self.running
        # The window's loss began after window_from, before a resume perhaps; its clock, in this process.
        steps = progress.global_step - max(progress.window_from, self.at.global_step)
        skipped = run.strategy.precision.skipped
        totals = reduce_window(run.env, running.window_values(), self.take_own_s(),
                               running.first_nonfinite_step(), skipped)
        now = device_clock(run.env.device)
        rate, loss = window_samples / max(now - window_start, 1e-9), totals.loss
        values: dict[str, Any] = {"train_loss": loss, "lr": self.step_lr, "samples_per_s": rate,
                                  "wall_s": now - self.started, **totals.skew(steps)}
        if self.grad_norm is not None:   # the last step's, before clipping (the same on every rank)
            values["grad_norm"] = float(self.grad_norm)
            self.grad_norm = None
        # Token data: tokens/s, and MFU where the device's peak is known (loop.rows).
        counted = run.count.take_targets() if run.count is not None else None
        values.update(run.throughput.values(run.throughput.tokens(window_samples, counted), now - window_start))
        if skipped is not None:
            values["skipped_steps"] = self.at.skipped_steps + totals.skipped
        if bar is not None:
            bar.set_postfix_str(bar_postfix(loss, steps, rate, values.get("grad_norm"),
                                            values.get("tokens_per_s"), values.get("mfu")))
        running.new_window()
        result.window_loss, result.window_steps = loss, (progress.window_from + 1, progress.global_step)
        progress.window_from = progress.global_step
        self.emit(Row("step", epoch + 1, progress.global_step, progress.samples, values, totals, steps,
                      (now - window_start) / max(steps, 1)))
        self.restart_clock()  # the wait in this all-reduce is no rank's own work
        return time.perf_counter()

    def _report_recovery(self, epoch: int) -> None:
        """After a fault, at the first step (the recovery is complete there): a line, a ``recovery``
        row and an entry of ``recovery.json``. Only a group that torchrun restarted has one."""
        recovery, self.recovery = self.recovery, None
        assert recovery is not None
        recovery.first_step = time.time()
        self.say(f"scaleloop: {recovery.describe()}")
        # The row's samples are those trained before the fault's restart, as metrics.csv has always
        # recorded them (this step's are counted after it).
        self.emit(Row("recovery", epoch + 1, self.progress.global_step, self.progress.samples,
                      dict(world_size=recovery.world_after, recovery_s=recovery.phases["total_s"])))
        if self.run_dir is not None:
            try:
                recovery.write(self.run_dir)
            except OSError as exc:
                self.say(f"warning: {self.run_dir / RECOVERY_FILE} could not be written: {exc}")


    # --- watching the step (loop.step.Observer) ------------------------------------------
    def restart_clock(self) -> None:
        """The next step's own time starts now (after a pause: evaluation, checkpoint, a log row)."""
        if self.clocked:
            self.last_progress = self._loss_known = time.perf_counter()

    def take_own_s(self) -> float:
        """This rank's own seconds since the last call (then counted from zero again)."""
        own, self.own_s = self.own_s, 0.0
        return own

    def micro_batch(self, batch: Batch) -> None:
        if self.on_batch is not None:
            self.on_batch(batch)

    def forward_done(self, loss: torch.Tensor) -> None:
        if self.clocked:
            self._loss_known = time.perf_counter()

    def synced(self) -> None:
        if self.gradient_bytes is None:
            self.gradient_bytes = gradient_bytes(self.run.model)
        if self.clocked:
            # A rank that computes no loss (a pipeline's earlier stage) counts the step up to here.
            began = self.last_progress
            self.own_s += (self._loss_known if self._loss_known > began else time.perf_counter()) - began

    def stepped(self) -> None:
        if self.clocked:
            self.last_progress = time.perf_counter()


def _epoch_complete(sampler: Any, in_epoch: int) -> bool:
    """Whether ``in_epoch`` steps complete the epoch: a stream's sampler knows its length only once a
    reader has reached the stream's end (before the pass's last step trains)."""
    return sampler.steps_per_epoch is not None and in_epoch >= sampler.steps_per_epoch
