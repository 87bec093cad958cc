"""The training loop behind ``scaleloop train``.

``train`` builds the run, restores a checkpoint if there is one, opens the run directory and
hands them to a :class:`Trainer`. Read :meth:`Trainer.train_epoch` top to bottom: for every
micro-batch ``Step.micro``, after the last micro-batch of a step ``Step.update``, a log row
every ``--log-every`` steps, a checkpoint every ``--checkpoint-every``; at the epoch's end
(:meth:`Trainer.end_epoch`) the loss reduced over ranks, the test set, the epoch's row and a
checkpoint; at the end (:meth:`Trainer.finish`) the weights and the result. Everything that
differs between 1 and N workers is the strategy's (``scaleloop.strategies``); the step itself
is ``scaleloop.loop.step``.

What else happens at a step's end or at a row is a :class:`Hook`, wired once per run and only
where it has something to do: the rows of ``metrics.csv`` and the tracker (:class:`MetricsRows`,
rank 0), the health checks on each log row's all-reduce (:class:`HealthChecks`: a straggling
rank, a diverging loss; ``scaleloop.loop.health``), the preemption stop vote
(:class:`StopOnSignal`, ``scaleloop.loop.preempt``) and, after a fault, the recovery report
(:class:`RecoveryReport`).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset, IterableDataset

from scaleloop.checkpoint.manager import Checkpointer, Progress, Resumed
from scaleloop.checkpoint.resume import run_dir_for
from scaleloop.checkpoint.claim import claim_run_dir
from scaleloop.config import TrainConfig, to_toml
from scaleloop.data.loader import Batch
from scaleloop.data.streaming import StreamingLoader, declared_length
from scaleloop.loop.build import Run, build_run
from scaleloop.loop.ending import record_ending
from scaleloop.loop.evaluate import EvalResult
from scaleloop.loop.evaluations import Evaluations
from scaleloop.loop.hooks import HealthChecks, Hook, MetricsRows, RecoveryReport, Row, StopOnSignal, chain, overrides
from scaleloop.loop.health import Stragglers, diverged, reduce_checked, reduce_window
from scaleloop.loop.preempt import StopVote
from scaleloop.loop.running import RunningLoss
from scaleloop.loop.schedule import describe_schedule
from scaleloop.loop.startwatch import StartupWatch
from scaleloop.loop.step import Step
from scaleloop.loop.tasks import describe_task
from scaleloop.output.memory import RankMemory, measure, reset_peak, write_json
from scaleloop.output.metrics import MetricsLogger, plot_curves
from scaleloop.output.rundir import (LOGS_DIR, RunDirWriteError, refuse_if_in_use,
                                     unwritable, write_atomic)
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.devices import describe_device, device_clock, to_cpu
from scaleloop.runtime.dist import DistEnv, launched_by_torchrun, restart_count
from scaleloop.runtime.frames import note_where
from scaleloop.runtime.recovery import Recovery, take_faults

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    """What a finished run reports (the numbers are reduced over all ranks)."""

    run_dir: Optional[Path]
    device: str
    strategy: str
    world_size: int
    precision: str
    epochs: int
    steps: int
    samples: int
    train_loss: float
    test: Optional[EvalResult]
    samples_per_s: float
    train_s: float
    wall_s: float
    parameters: int
    dropped_per_epoch: int
    in_memory_data: bool
    train_samples: int = 0
    steps_per_epoch: int = 0
    last_step_samples: int = 0
    lr: str = ""
    weight_decay: str = ""           # which tensors weight decay applied to ("" without it)
    checkpoints_written: int = 0
    checkpoint_s: float = 0.0
    last_checkpoint: Optional[Path] = None
    resumed_from: Optional[Path] = None
    memory: tuple[RankMemory, ...] = ()
    streamed: bool = False           # the training set is a stream (docs/streaming.md)
    skipped_steps: int = 0           # fp16: optimizer steps the GradScaler skipped (counted in ``steps``)
    straggler: str = ""              # the worst straggler reported during the run ("" if none)
    train_loss_over: str = ""        # which steps ``train_loss`` is the mean over ("epoch 2, steps 11-20")
    window_loss: float = float("nan")   # the last log row's train loss (the mean over its window) ...
    window_steps: tuple[int, int] = (0, 0)   # ... and that window's first and last global step
    train_eval: Optional[EvalResult] = None   # --eval-train: the last training loss in evaluation mode ...
    train_eval_step: int = 0         # ... and the global step it was taken at


@dataclass
class Ledger:
    """What the loop counts as it goes, and what :meth:`Trainer.finish` reports."""

    started: float
    step: int = 0
    samples: int = 0
    train_s: float = 0.0
    epochs_run: int = 0
    train_loss: float = float("nan")
    lr: float = 0.0
    test: Optional[EvalResult] = None
    skipped_before: int = 0          # fp16 steps skipped before this process (from the checkpoint)
    skipped: int = 0                 # ... and in all, as of the last log row
    window_from: int = 0             # the global step the current log window started after
    out: Optional[Path] = None       # the run directory, as every rank knows it (for messages)
    stragglers: Stragglers = field(default_factory=Stragglers)
    train_loss_over: str = ""        # which steps ``train_loss`` is the mean over
    window_loss: float = float("nan")   # the last log row's train loss, over steps window_steps
    window_steps: tuple[int, int] = (0, 0)
    train_eval: Optional[EvalResult] = None   # --eval-train's last result, at step train_eval_step
    train_eval_step: int = 0
    eval_row_step: int = -1          # the step of the last ``eval`` row (one per step at most)


# The bar: how far the epoch is, the time left, then (from the first log row on) the postfix
# ``_bar_postfix`` writes. tqdm's own step/s is left out: samples/s says it, and without it the
# line fits 80 columns.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {remaining} left{postfix}"
# A stream's first pass has no known length: steps so far and the time, no share or time left.
UNSIZED_BAR_FORMAT = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"


def _progress_bar(total: Optional[int], initial: int, desc: str, enabled: bool):  # -> tqdm | None
    if not enabled:
        return None
    width = _terminal_width(sys.stderr)
    if width == 0:
        # A terminal that reports no width (0 columns): a bar redrawn in place there wraps into
        # stray lines. The epoch lines say how the run goes.
        return None
    from tqdm import tqdm  # imported here: only rank 0 with a progress bar needs it

    # disable=None: a bar on a terminal, plain epoch lines in a log file or CI.
    return tqdm(total=total, initial=initial, desc=desc, bar_format=BAR_FORMAT if total else UNSIZED_BAR_FORMAT,
                dynamic_ncols=width is None, ncols=width, leave=True, disable=None)


def _terminal_width(stream: Any) -> Optional[int]:
    """The bar's width on ``stream``: None to follow the terminal (or not a terminal: tqdm shows no
    bar), a fixed width where the terminal reports 0 columns but ``COLUMNS`` gives one, else 0."""
    try:
        if not stream.isatty() or os.get_terminal_size(stream.fileno()).columns > 0:
            return None
    except (AttributeError, OSError, ValueError):  # no file descriptor (a captured stream)
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else 0


def _bar_postfix(loss: float, steps: int, samples_per_s: float) -> str:
    """What the bar shows after a log row: the mean loss of the steps since the previous row (not
    the epoch's running mean, which the epoch line prints), and the samples per second."""
    return f"loss {loss:.4f} (last {steps} step{'s' if steps != 1 else ''}), {samples_per_s:,.0f} samples/s"


STARTING_UP = "starting up (reading the data, building the model, its strategy and its optimizer)"


def train(cfg: TrainConfig, env: DistEnv, log: Optional[Log] = None,
          on_batch: Optional[Callable[[Batch], None]] = None) -> RunResult:
    """Run the training that ``cfg`` describes on ``env``; rank 0 writes the run directory.

    ``on_batch`` (optional) sees every micro-batch this rank trains on, before its forward pass.
    """
    started, joined = time.perf_counter(), time.time()   # (called once the process group is formed)
    say: Log = (log or print) if env.is_main else (lambda _msg: None)
    reset_peak(env.device)  # this run's peak CUDA memory, not an earlier run's in this process
    if env.is_main:
        refuse_if_in_use(run_dir_for(cfg))   # before its checkpoints are read: "in use" is the reason
    try:
        with StartupWatch(say) if env.is_main else contextlib.nullcontext():   # a slow step says so
            run = build_run(cfg, env)
            checkpointer = Checkpointer(run.strategy, cfg.checkpointing, cfg.flat(), seed=cfg.seed, say=say)
            resumed = checkpointer.restore(run.model, run.optimizer, run.scheduler, restarting=restart_count() > 0)
            _stream_state(run, checkpointer, resumed)
    except BaseException as exc:   # for the launcher's report: before any step
        note_where(exc, epoch=None, step=0, during=STARTING_UP)
        raise
    run_dir, lock = _open_run_dir(run, checkpointer, resumed)
    recovery = _recovery(cfg, env, joined, resumed)
    with lock:  # released at the end, however the run ends
        trainer = Trainer(run, checkpointer, say, started, run_dir=run_dir, resumed=resumed, on_batch=on_batch)
        try:
            return trainer.fit(recovery)
        except BaseException as exc:
            record_ending(run_dir, exc, trainer.ledger.step)  # for scaleloop doctor, while the lock is held
            raise


def _stream_state(run: Run, checkpointer: Checkpointer, resumed: Optional[Resumed]) -> None:
    """A stateful stream's place is saved with each checkpoint and loaded on resume (no re-read)."""
    if isinstance(run.loader, StreamingLoader):
        checkpointer.data_state = run.loader.state_dict
        if resumed is not None:
            run.loader.load_state_dict(resumed.data)


class Trainer:
    """One run's loop and what it carries from step to step: the run, its checkpointer, the
    metrics logger (rank 0), the running loss, the ledger, the step and the hooks.

    ``train`` makes one per run; ``bench`` makes one to time :meth:`log_row`. Making one opens
    ``metrics.csv`` and the tracker (when ``run_dir`` is given) and nothing else: no line is said
    and no signal handler installed until :meth:`fit`, which announces the run and adds the stop
    vote, so the bench's process keeps its own signal handling.
    """

    def __init__(self, run: Run, checkpointer: Checkpointer, say: Log, started: float, *,
                 run_dir: Optional[Path] = None, resumed: Optional[Resumed] = None,
                 on_batch: Optional[Callable[[Batch], None]] = None) -> None:
        cfg = self.cfg = run.cfg
        self.run, self.env, self.checkpointer, self.say = run, run.env, checkpointer, say
        self.run_dir, self.resumed, self.on_batch = run_dir, resumed, on_batch
        at = self.at = resumed.progress if resumed is not None else Progress()
        self.metrics: Optional[MetricsLogger] = (
            MetricsLogger(run_dir, tensorboard=cfg.tensorboard, tracker=cfg.tracker, config=cfg,
                          keep_until_step=at.global_step if resumed is not None or restart_count() > 0 else None)
            if run_dir is not None else None)
        self.ledger = Ledger(started, at.global_step, at.samples, at.train_s, at.epoch,
                             lr=run.optimizer.param_groups[0]["lr"], skipped_before=at.skipped_steps,
                             skipped=at.skipped_steps, window_from=at.global_step, out=run_dir or run_dir_for(cfg))
        self.running = RunningLoss()  # loss x samples and samples, of the epoch and of the log window
        if resumed is not None:
            self.running.load(resumed.sums)
        self.step = Step(run)
        self.evals = Evaluations(run.model, cfg.evaluation, run.data, run.strategy, batch_size=cfg.batch_size,
                                 seed=cfg.seed, loss_fn=run.loss_fn if run.user_loss else None,
                                 keep_target=run.loader.keep_target, metrics=run.metrics)
        #: What the loop does when not a training step (an evaluation, a checkpoint), for the report.
        self.doing: Optional[str] = None
        #: In call order (within an event, order counts: the metrics row before the health checks
        #: that may stop the run on it). Add more with :meth:`add_hook`.
        self.hooks: list[Hook] = ([MetricsRows(self.metrics)] if self.metrics is not None else []) + [HealthChecks()]
        self._wire()

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook`` too, after the hooks there are, at the events its class overrides."""
        self.hooks.append(hook)
        self._wire()

    def _wire(self) -> None:
        """Each event's hooks as one callable, or None (looked up once per epoch, not per step)."""
        self._first_step = chain([h.first_step for h in self.hooks if overrides(h, "first_step")])
        self._after_step = chain([h.after_step for h in self.hooks if overrides(h, "after_step")])
        self._on_row = chain([h.on_row for h in self.hooks if overrides(h, "on_row")])

    def emit(self, row: Row) -> None:
        """Hand ``row`` to the hooks that take rows (metrics.csv, the tracker, the health checks)."""
        if self._on_row is not None:
            self._on_row(self, row)

    def fit(self, recovery: Optional[Recovery] = None) -> RunResult:
        """The epochs from the checkpoint's place on; then the final weights and the result.

        ``recovery``: what the attempt before a fault left, reported after the first step.
        """
        cfg, ledger, at = self.cfg, self.ledger, self.at
        _announce(self.run, self.resumed, self.say)
        evaluations = self.evals.describe()
        if evaluations is not None:
            self.say(evaluations)
        done = _nothing_left(cfg, at, self.say)
        vote = StopVote(self.env, cfg.signal, torchrun_worker=launched_by_torchrun())  # preemption (loop/preempt.py)
        if recovery is not None:
            self.add_hook(RecoveryReport(recovery))
        self.add_hook(StopOnSignal(vote))
        self.run.model.train()
        try:
            for epoch in range(at.epoch, cfg.epochs):
                if done:
                    break
                done = self.train_epoch(epoch, at.step_in_epoch if epoch == at.epoch else 0)
            if vote.stopped_after is not None:  # the checkpoint is written: end with how to continue
                raise vote.preempted(ledger.out, self.checkpointer.last_step, checkpoints=cfg.checkpoints,
                                    machines=cfg.nnodes, requeue_job=cfg.requeue)
        except RunDirWriteError as exc:  # rank 0's own files (metrics.csv): add where the run can go on from
            note_where(exc, epoch=ledger.epochs_run + 1, step=ledger.step + 1, during=self.doing)
            raise exc.with_hint(self.checkpointer.continue_hint(exc.once)) from None
        except BaseException as exc:  # where the loop was, for the launcher's failure report
            note_where(exc, epoch=ledger.epochs_run + 1, step=ledger.step + 1,
                       last_progress=time.time() - (time.perf_counter() - self.step.last_progress), during=self.doing)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.close()
        return self.finish()

    def train_epoch(self, epoch: int, first_step: int) -> bool:
        """Epoch ``epoch`` from its step ``first_step`` on, then its end; True when the run stops
        in it (``--max-steps``, or a hook such as the stop vote)."""
        cfg, env, ledger, step, loader = self.cfg, self.env, self.ledger, self.step, self.run.loader
        plan = loader.plan
        loader.set_epoch(epoch, first_step)
        if first_step == 0:
            self.running.new_epoch()
        in_epoch, done = first_step, False
        bar = _progress_bar(plan.steps_per_epoch, first_step, f"epoch {epoch + 1}/{cfg.epochs}",
                            cfg.progress and env.is_main)
        # The clock waits for the GPU (device_clock): it runs behind the loop, and a time read
        # with steps still queued makes samples/s look better than it is. Free on the CPU.
        epoch_start = window_start = device_clock(env.device)
        window_samples = 0
        step.restart_clock()
        # Looked up once: the loop below runs once per micro-batch, and a small model's step takes
        # well under a millisecond on a CPU, so every lookup and call in it shows.
        micro, update, add, on_batch = step.micro, step.update, self.running.add, self.on_batch
        first, after_step = self._first_step, self._after_step
        log_every, max_steps, checkpoint_every, eval_every = (cfg.log_every, cfg.max_steps, cfg.checkpoint_every,
                                                              cfg.eval_every)
        for batch in loader:
            if on_batch is not None:
                on_batch(batch)
            loss = micro(batch)
            where = batch.plan
            if loss is not None:  # None: this rank computes no loss (a pipeline's earlier stage)
                add(loss, len(batch), ledger.step + 1)
            if not where.last_micro:
                continue
            ledger.lr = update()
            done_steps = ledger.step = ledger.step + 1
            if first is not None:
                first(self, epoch)
                first = self._first_step = None
            in_epoch = where.step + 1
            ledger.samples += where.step_samples
            window_samples += where.step_samples
            if bar is not None:
                bar.update(1)
            if done_steps % log_every == 0:
                window_start = self.log_row(epoch, window_samples, window_start, bar)
                window_samples = 0
            # Every rank ends at --max-steps, or where a hook says so (the stop vote).
            if (max_steps is not None and done_steps >= max_steps) or (after_step is not None
                                                                        and after_step(self, epoch)):
                done = True
                break
            if ((eval_every and done_steps % eval_every == 0) or (checkpoint_every and done_steps % checkpoint_every
                                                                  == 0)) and not _epoch_complete(plan, in_epoch):
                paused = self.pause_inside(epoch, in_epoch, done_steps, epoch_start)
                epoch_start += paused   # not training time, as at the epoch's end
                window_start += paused
        ledger.train_s += device_clock(env.device) - epoch_start
        if bar is not None:
            bar.close()
        self.end_epoch(epoch, in_epoch)
        return done

    def log_row(self, epoch: int, window_samples: int, window_start: float, bar: Any = None) -> float:
        """The log row of the global loss since the last one (a collective), handed to the hooks;
        returns the new window's start. ``window_samples`` trained since ``window_start``.

        The same all-reduce gathers each rank's own time, first non-finite step and fp16 skipped
        steps (``scaleloop.loop.health``), which :class:`HealthChecks` reads.
        """
        run, ledger, step, running = self.run, self.ledger, self.step, self.running
        steps = ledger.step - ledger.window_from
        skipped = run.strategy.precision.skipped
        totals = reduce_window(run.env, running.window_values(), step.take_own_s(),
                               running.first_nonfinite_step(), skipped)
        now = device_clock(run.env.device)
        rate = window_samples / max(now - window_start, 1e-9)
        values: dict[str, Any] = dict(train_loss=totals.loss, lr=ledger.lr, samples_per_s=rate,
                                      wall_s=now - ledger.started, **totals.skew(steps))
        if skipped is not None:
            ledger.skipped = values["skipped_steps"] = ledger.skipped_before + totals.skipped
        if bar is not None:
            bar.set_postfix_str(_bar_postfix(totals.loss, steps, rate))
        running.new_window()
        ledger.window_loss, ledger.window_steps = totals.loss, (ledger.window_from + 1, ledger.step)
        ledger.window_from = ledger.step
        self.emit(Row("step", epoch + 1, ledger.step, ledger.samples, values, totals, steps,
                      (now - window_start) / max(steps, 1)))
        step.restart_clock()  # the wait in this all-reduce is no rank's own work
        return time.perf_counter()

    def check_finite(self, epoch: int, head: list[float]) -> list[float]:
        """``head`` summed over ranks; raises :class:`~scaleloop.loop.health.Diverged` on every rank
        alike if a loss so far or the weights are not finite, before a checkpoint could hold them."""
        sums, first, ranks = reduce_checked(self.env, self.run.model, head, self.running.first_nonfinite_step())
        if first is not None or ranks:
            what = ("the training loss became non-finite" if first is not None
                    else "the weights were no longer finite (inf or NaN) after")
            raise diverged(what, first or self.ledger.step, epoch + 1, self.ledger.out, self.checkpointer.last_step,
                           ranks, self.env.world_size)
        return sums

    def skipped(self) -> int:
        """fp16 steps the scaler skipped, this process's and before it (reads the device)."""
        return self.ledger.skipped_before + self.run.strategy.precision.skipped_steps()

    def checkpoint(self, where: Progress, train_s: float) -> float:
        """A checkpoint inside an epoch (``where``: epoch and step in it); returns the seconds it took."""
        run, ledger = self.run, self.ledger
        pause = device_clock(run.env.device)  # queued steps are training time, not the checkpoint's
        if self.metrics is not None:
            self.metrics.flush()   # the rows up to the checkpoint, on disk with it
        if run.cfg.checkpoints:   # one small all-reduce per checkpoint: no checkpoint of a diverged run
            self.check_finite(where.epoch, [])
        self.doing = f"writing the checkpoint of step {ledger.step}"
        self.checkpointer.save(run.model, run.optimizer, run.scheduler,
                               Progress(where.epoch, where.step_in_epoch, ledger.step, ledger.samples, train_s,
                                        self.skipped()),
                               self.running.state(run.env.device))
        self.doing = None
        return time.perf_counter() - pause

    def end_epoch(self, epoch: int, in_epoch: int) -> None:
        """The epoch's global loss, the test set, the epoch's row and line, and a checkpoint.

        Where the run stopped inside the epoch (``--max-steps``, a stop vote), the row is a
        ``stop`` row: the run that resumes it writes the epoch's row, once.
        """
        run, ledger = self.run, self.ledger
        ledger.epochs_run = epoch + 1
        total = self.check_finite(epoch, self.running.epoch_sums(torch.device("cpu")).tolist())
        ledger.train_loss = total[0] / total[1] if total[1] > 0 else float("nan")
        finished = _epoch_complete(run.loader.plan, in_epoch)
        ledger.train_loss_over = (f"epoch {epoch + 1}{'' if finished else ' so far'}, "
                                  f"steps {ledger.step - in_epoch + 1}-{ledger.step}")
        self.doing = f"the evaluation after epoch {epoch + 1}"
        test = ledger.test = self.evaluate()
        train = self.eval_train()
        self.doing = None
        if self.evals.due(ledger.step) and ledger.eval_row_step != ledger.step:
            self.emit_eval(epoch, test, train)   # the step's --eval-every row, from the same evaluation
        skipped = self.skipped()
        self.emit(Row("epoch" if finished else "stop", epoch + 1, ledger.step, ledger.samples, dict(
            train_loss=ledger.train_loss, test_loss=test.loss if test else None,
            test_acc=test.accuracy if test else None, lr=ledger.lr,
            samples_per_s=ledger.samples / max(ledger.train_s, 1e-9), wall_s=time.perf_counter() - ledger.started,
            skipped_steps=skipped if run.strategy.precision.skipped is not None else None,
            train_eval_loss=train.loss if train else None)))
        self.say(f"epoch {epoch + 1}: train loss {ledger.train_loss:.4f}"
                 + "".join(f", {part}" for part in _describe_evals(test, train)))
        # At the epoch's end (or where the run stopped inside it): the next run starts after it.
        self.doing = f"writing the checkpoint of step {ledger.step}"
        self.checkpointer.save(run.model, run.optimizer, run.scheduler,
                               Progress(epoch + 1 if finished else epoch, 0 if finished else in_epoch,
                                        ledger.step, ledger.samples, ledger.train_s, skipped),
                               self.running.state(run.env.device))
        self.doing = None

    def evaluate(self) -> Optional[EvalResult]:
        """The test set's (or its ``--eval-batches`` sample's) loss, accuracy and the user's
        metrics (None without a test set)."""
        return self.evals.test()

    def eval_train(self) -> Optional[EvalResult]:
        """With ``--eval-train``: the training loss in evaluation mode, kept for the summary."""
        train = self.evals.train()
        if train is not None:
            self.ledger.train_eval, self.ledger.train_eval_step = train, self.ledger.step
        return train

    def pause_inside(self, epoch: int, in_epoch: int, done_steps: int, epoch_start: float) -> float:
        """The evaluation and the checkpoint due after step ``done_steps`` inside an epoch (not at its
        end, where ``end_epoch`` does both); returns the seconds they took. The evaluation comes
        first: a run resumed from the checkpoint goes on to the next multiple."""
        cfg, paused = self.cfg, 0.0
        if cfg.eval_every and done_steps % cfg.eval_every == 0:
            paused += self.eval_inside(epoch)
        if cfg.checkpoint_every and done_steps % cfg.checkpoint_every == 0:
            train_s = self.ledger.train_s + time.perf_counter() - (epoch_start + paused)
            paused += self.checkpoint(Progress(epoch, in_epoch), train_s)
        self.step.restart_clock()
        return paused

    def eval_inside(self, epoch: int) -> float:
        """The evaluation at this step inside epoch ``epoch`` (every ``--eval-every`` steps): its
        row and line; returns the seconds it took. It draws none of the training's random
        numbers, so that the run trains exactly as it would without it."""
        pause = device_clock(self.env.device)  # queued steps are training time, not the evaluation's
        self.doing = f"the evaluation at step {self.ledger.step}"
        test = self.evals.test(isolated=True)
        train = self.eval_train()
        self.doing = None
        self.emit_eval(epoch, test, train)
        return time.perf_counter() - pause

    def emit_eval(self, epoch: int, test: Optional[EvalResult], train: Optional[EvalResult]) -> None:
        """The ``eval`` row of an evaluation at this step, and its line."""
        ledger = self.ledger
        ledger.eval_row_step = ledger.step
        self.emit(Row("eval", epoch + 1, ledger.step, ledger.samples, dict(
            test_loss=test.loss if test else None, test_acc=test.accuracy if test else None,
            train_eval_loss=train.loss if train else None, wall_s=time.perf_counter() - ledger.started)))
        self.say(f"step {ledger.step}: " + ", ".join(_describe_evals(test, train)))

    def finish(self) -> RunResult:
        """Final weights (the user's own module, unsharded: a collective for a sharded strategy),
        memory per rank, curves, and the result."""
        run, ledger, checkpointer = self.run, self.ledger, self.checkpointer
        env, strategy, plan = run.env, run.strategy, run.loader.plan
        if ledger.test is None:
            ledger.test = self.evaluate()  # nothing trained: the checkpoint's model
        final_weights = strategy.full_state_dict(run.model)
        memory = tuple(gather_object(measure(run.model, run.optimizer, env.rank, env.device, self.step.gradient_bytes,
                                             run.model_bytes), env))
        strategy.close()
        skipped = self.skipped()
        if self.run_dir is not None:
            self._write_outputs(final_weights, memory)
        return RunResult(
            run_dir=self.run_dir, device=describe_device(env.device), strategy=strategy.describe(),
            world_size=env.world_size, precision=run.cfg.precision, epochs=ledger.epochs_run, steps=ledger.step,
            samples=ledger.samples, train_loss=ledger.train_loss, test=ledger.test,
            samples_per_s=ledger.samples / max(ledger.train_s, 1e-9), train_s=ledger.train_s,
            wall_s=time.perf_counter() - ledger.started, parameters=run.parameters,
            dropped_per_epoch=plan.dropped_per_epoch, in_memory_data=run.loader.in_memory,
            train_samples=plan.n or 0, steps_per_epoch=plan.steps_per_epoch or 0,
            last_step_samples=len(plan.step_indices(0, plan.steps_per_epoch - 1)) if plan.steps_per_epoch else 0,
            lr=describe_schedule(run.cfg.optim, run.lr, run.total_steps), weight_decay=run.weight_decay,
            checkpoints_written=checkpointer.written,
            checkpoint_s=checkpointer.seconds, last_checkpoint=checkpointer.last_path,
            resumed_from=self.resumed.source if self.resumed is not None else None, memory=memory,
            streamed=isinstance(run.data.train, IterableDataset), skipped_steps=skipped,
            straggler=ledger.stragglers.worst.describe() if ledger.stragglers.worst is not None else "",
            train_loss_over=ledger.train_loss_over, window_loss=ledger.window_loss, window_steps=ledger.window_steps,
            train_eval=ledger.train_eval, train_eval_step=ledger.train_eval_step)

    def _write_outputs(self, final_weights: dict[str, Any], memory: tuple[RankMemory, ...]) -> None:
        """Rank 0: ``model.pt``, ``memory.json`` and ``curves.png`` in the run directory."""
        run_dir, checkpointer = self.run_dir, self.checkpointer
        assert run_dir is not None
        buf = io.BytesIO()
        torch.save(to_cpu(final_weights), buf)  # on CPU for every strategy: loads anywhere
        try:
            write_atomic(run_dir / "model.pt", buf.getvalue())
            write_json(run_dir / "memory.json", memory, self.run.strategy.name)
            plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
        except RunDirWriteError as exc:
            raise exc.with_hint(checkpointer.continue_hint(exc.once)) from None
        except OSError as exc:   # memory.json, curves.png
            raise unwritable(run_dir, exc).with_hint(checkpointer.continue_hint("the disk has space")) from None


def _recovery(cfg: TrainConfig, env: DistEnv, joined: float, resumed: Optional[Resumed]) -> Optional[Recovery]:
    """On rank 0 of a group that torchrun restarted after a fault: what the attempt before left
    (every machine's records, a collective), to report once the first step is done."""
    if not launched_by_torchrun() or (env.world_size == 1 and restart_count() == 0):
        return None
    mine = take_faults(Path(cfg.out) / LOGS_DIR) if env.local_rank == 0 and cfg.out else []
    records = [r for rank_records in gather_object(mine, env) for r in rank_records]
    if not env.is_main:
        return None
    found = Recovery.from_records(records, env.world_size, joined)
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
        claim = claim_run_dir(run_dir_for(run.cfg), run.cfg.model, run.cfg.data,
                              source=resumed.source if resumed is not None else None,
                              restarting=restart_count() > 0,
                              from_copy=resumed is not None and resumed.copy_on_rank is not None,
                              nnodes=run.cfg.nnodes)
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


def _announce(run: Run, resumed: Optional[Resumed], say: Log) -> None:
    """The run's header: what trains on what, how, and where it continues from."""
    cfg, env, data, plan = run.cfg, run.env, run.data, run.loader.plan
    say(f"scaleloop: {cfg.model} ({run.parameters:,} parameters) on {data.info.name} "
        f"({_size(data.train)} train / {_size(data.test) if data.test is not None else 0} test), "
        f"{run.strategy.describe()} x {env.world_size} on {describe_device(env.device)}, {cfg.precision}")
    say(describe_task(data.info, cfg.loss, getattr(run.loader, "keep_target", False)))
    for line in run.strategy.details() + run.notes:
        say(line)
    if cfg.lr_scaling != "none" or cfg.lr_schedule != "constant" or cfg.warmup_steps:
        say(f"learning rate {describe_schedule(cfg.optim, run.lr, run.total_steps)}")
    if run.weight_decay:
        say(f"weight decay {run.weight_decay}")
    if plan.dropped_per_epoch:
        say(f"note: the last {plan.dropped_per_epoch} sample(s) of each shuffled epoch are dropped "
            f"({'--drop-last' if cfg.drop_last else 'too few to give every worker and micro-step one'})")
    if resumed is not None:
        at = resumed.progress
        where = (f"epoch {at.epoch + 1}, step {at.step_in_epoch}"
                 + (f" of {plan.steps_per_epoch}" if plan.steps_per_epoch is not None else "")
                 if at.step_in_epoch else f"the end of epoch {at.epoch}")
        say(f"resuming from {resumed.source} (global step {at.global_step}: {where}); any steps an "
            "interrupted run took after it are trained again")
        for note in resumed.notes:
            say(note)
    elif restart_count() > 0:
        say(f"restart {restart_count()}: no checkpoint was written before the failure; starting over")


def _size(dataset: Dataset) -> str:
    """A dataset's size for the header (a stream's is unknown unless it has a ``__len__``)."""
    n = declared_length(dataset)
    if not isinstance(dataset, IterableDataset):
        return f"{n:,}"
    return "streamed" if n is None else f"{n:,} streamed"


def _epoch_complete(plan: Any, in_epoch: int) -> bool:
    """Whether ``in_epoch`` steps complete the epoch: a stream's plan knows its length only once a
    reader has reached the stream's end (before the pass's last step trains)."""
    return plan.steps_per_epoch is not None and in_epoch >= plan.steps_per_epoch


def _nothing_left(cfg: TrainConfig, at: Progress, say: Log) -> bool:
    """True (and says so) when the checkpoint already reached the run's end."""
    if (cfg.max_steps is None or at.global_step < cfg.max_steps) and at.epoch < cfg.epochs:
        return False
    say(f"nothing left to train: the checkpoint is at step {at.global_step}, epoch {at.epoch} of {cfg.epochs}"
        + (f", --max-steps {cfg.max_steps}" if cfg.max_steps is not None else "")
        + "; raise --epochs or --max-steps to train further")
    return True


def describe_test(test: EvalResult) -> str:
    """``test loss L, test accuracy A, <metric> V``: what the task has (no accuracy for a regression);
    `` (sampled: n of N)`` after them for an ``--eval-batches`` sample."""
    parts = [f"test loss {test.loss:.4f}"]
    if test.accuracy == test.accuracy:  # not NaN
        parts.append(f"test accuracy {test.accuracy:.2%}")
    parts += [f"{name} {value:.4g}" for name, value in test.metrics.items()]
    return ", ".join(parts) + (f" (sampled: {test.samples:,} of {test.of:,})" if test.of is not None else "")


def describe_train_eval(train: EvalResult) -> str:
    """``train loss (sampled) L``: ``--eval-train``'s training loss in evaluation mode."""
    return f"train loss ({'sampled' if train.of is not None else 'eval mode'}) {train.loss:.4f}"


def _describe_evals(test: Optional[EvalResult], train: Optional[EvalResult]) -> list[str]:
    return ([describe_test(test)] if test else []) + ([describe_train_eval(train)] if train else [])
