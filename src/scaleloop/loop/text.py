"""What the loop prints: the run's header, the progress bar, the lines after an evaluation, and
the end-of-run summary that ``scaleloop train`` prints (:func:`format_result`).

Rank 0 prints; the trainer (``loop.trainer``) decides when.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

from torch.utils.data import Dataset, IterableDataset

from scaleloop.checkpoint.manager import Progress, Resumed
from scaleloop.config import TrainConfig
from scaleloop.data.streaming import declared_length
from scaleloop.loop.build import Run, describe_schedule
from scaleloop.loop.evaluation import EvalResult
from scaleloop.loop.losses import describe_task
from scaleloop.loop.result import RunResult
from scaleloop.output.footprint import format_table, summary_line
from scaleloop.output.metrics import format_rate, format_seconds, format_summary
from scaleloop.runtime.devices import describe_device
from scaleloop.runtime.dist import restart_count
from scaleloop.strategies import batch_split_of


#: Where a line goes: ``print`` on rank 0, nothing on the others.
Log = Callable[[str], None]

# The bar: how far the epoch is, the time left, then (from the first log row on) the postfix
# ``_bar_postfix`` writes. tqdm's own step/s is left out: samples/s says it. With the gradient norm
# the line is about 92 columns; on a narrower terminal tqdm trims its end (the speed).
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {remaining} left{postfix}"
# A stream's first pass has no known length: steps so far and the time, no share or time left.
UNSIZED_BAR_FORMAT = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"


def progress_bar(total: Optional[int], initial: int, desc: str, enabled: bool):  # -> tqdm | None
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


def bar_postfix(loss: float, steps: int, samples_per_s: float, grad_norm: Optional[float] = None,
                tokens_per_s: Optional[float] = None, mfu: Optional[float] = None) -> str:
    """What the bar shows after a log row: the mean loss of the steps since the previous row (not
    the epoch's running mean, which the epoch line prints), the last step's gradient norm before
    clipping, the tokens per second for token data (else the samples per second), and the MFU
    where it is known (``loop.rows``)."""
    norm = f", grad norm {grad_norm:.3g}" if grad_norm is not None else ""
    speed = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s is not None else f"{samples_per_s:,.0f} samples/s"
    share = f", MFU {mfu:.1%}" if mfu is not None else ""
    return f"loss {loss:.4f} (last {steps} step{'s' if steps != 1 else ''}){norm}, {speed}{share}"


def announce(run: Run, resumed: Optional[Resumed], say: Log) -> None:
    """The run's header: what trains on what, how, and where it continues from."""
    cfg, env, data, sampler = run.cfg, run.env, run.data, run.loader.sampler
    say(f"scaleloop: {cfg.model_data.model} ({run.parameters:,} parameters) on {data.info.name} "
        f"({_size(data.train)} train / {_size(data.test) if data.test is not None else 0} test), "
        f"{run.strategy.describe()} x {env.world_size} on {describe_device(env.device)}, {cfg.parallel.precision}")
    say(describe_task(data.info, cfg.model_data.loss, getattr(run.loader, "keep_target", False)))
    for line in run.strategy.details() + run.notes:
        say(line)
    if cfg.optim.lr_scaling != "none" or cfg.optim.lr_schedule != "constant" or cfg.optim.warmup_steps:
        say(f"learning rate {describe_schedule(cfg.optim, run.lr, run.total_steps)}")
    if run.weight_decay:
        say(f"weight decay {run.weight_decay}")
    if sampler.dropped_per_epoch:
        say(f"note: the last {sampler.dropped_per_epoch} sample(s) of each shuffled epoch are dropped "
            f"({'--drop-last' if cfg.optim.drop_last else 'too few to give every worker and micro-step one'})")
    if resumed is not None:
        at = resumed.progress
        where = (f"epoch {at.epoch + 1}, step {at.step_in_epoch}"
                 + (f" of {sampler.steps_per_epoch}" if sampler.steps_per_epoch is not None else "")
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


def nothing_left(cfg: TrainConfig, at: Progress, say: Log) -> bool:
    """True (and says so, in one line: it is no error) when the checkpoint already reached the run's
    end: ``--max-steps``, ``--epochs``, or both, each named with the flag that would go further."""
    steps_done = cfg.optim.max_steps is not None and at.global_step >= cfg.optim.max_steps
    epochs_done = at.epoch >= cfg.optim.epochs
    if not (steps_done or epochs_done):
        return False
    where, flags = f"the run already reached step {at.global_step}", []
    if steps_done:
        where += f" (--max-steps {cfg.optim.max_steps})"
        flags.append("--max-steps")
    if epochs_done:
        at_end = at.epoch == cfg.optim.epochs and at.step_in_epoch == 0
        where += f", {'the end' if at_end else 'past the end'} of epoch {cfg.optim.epochs} (--epochs {cfg.optim.epochs})"
        flags.append("--epochs")
    say(f"nothing left to train: {where}; pass a larger {' and '.join(flags)} to train further")
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


def describe_evals(test: Optional[EvalResult], train: Optional[EvalResult]) -> list[str]:
    return ([describe_test(test)] if test else []) + ([describe_train_eval(train)] if train else [])


# --- the end-of-run summary -----------------------------------------------------------------------

def format_result(result: RunResult) -> str:
    """The run's key facts, one per line, aligned."""
    test = result.test
    rows = [
        ("device", result.device),
        ("strategy", result.strategy),
        ("world size", str(result.world_size)),
        ("precision", result.precision),
        ("epochs", f"{result.epochs} ({result.steps} steps, {result.samples:,} samples)"),
        ("train loss", describe_train_loss(result)),
        _test_row(test),
        *([_train_eval_row(result.train_eval, result.train_eval_step)] if result.train_eval is not None else []),
        ("throughput", format_rate(result.samples_per_s)),
        ("wall time", _wall_time(result)),
    ]
    if result.precision == "fp16":
        rows.append(("fp16 skipped steps", f"{result.skipped_steps} of {result.steps} (inf/NaN gradients: the "
                     "GradScaler lowered its scale; they count toward --max-steps)"))
    if result.straggler:
        rows.append(("straggler", result.straggler.removeprefix("straggler: ")))
    rows.append(("data per epoch", describe_epoch(result)))
    if result.lr:
        rows.append(("learning rate", result.lr))
    if result.weight_decay:
        rows.append(("weight decay", result.weight_decay))
    rows.append(("checkpoints", describe_checkpoints(result)))
    if result.memory:
        rows.append(("memory per rank", summary_line(result.memory)))
    rows.append(("run directory", str(result.run_dir) if result.run_dir else "-"))
    text = "summary\n" + format_summary(rows)
    if len(result.memory) > 1:
        text += "\n" + format_table(result.memory)
    return text


def describe_train_loss(result: RunResult) -> str:
    """The run's train loss and what it is the mean of (the last epoch's steps, each batch's loss
    as it trained), then the last log row's."""
    text = f"{result.train_loss:.4f}"
    if result.train_loss_over:
        text += f", the mean over {result.train_loss_over}"
    first, last = result.window_steps
    if last:
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        text += f"; last log window ({steps}) {result.window_loss:.4f}"
    return text


def _samples(result: EvalResult) -> str:
    """``n samples``, or ``n of N samples, sampled`` for an ``--eval-batches`` sample."""
    return f"{result.samples:,} samples" if result.of is None else f"{result.samples:,} of {result.of:,} samples, sampled"


def _test_row(test: Optional[EvalResult]) -> tuple[str, str]:
    if test is None:
        return "test accuracy", "no test set"
    metrics = "".join(f", {name} {value:.4g}" for name, value in test.metrics.items())
    if test.accuracy != test.accuracy:  # NaN: a regression, or a model's own loss
        return "test loss", f"{test.loss:.4f}{metrics} ({_samples(test)})"
    return "test accuracy", f"{test.accuracy:.2%} (test loss {test.loss:.4f}{metrics}, {_samples(test)})"


def _train_eval_row(train: EvalResult, step: int) -> tuple[str, str]:
    """``--eval-train``'s last result: the training loss in evaluation mode (no dropout)."""
    key = "train loss (sampled)" if train.of is not None else "train loss (eval mode)"
    samples = f"{train.samples:,} samples" if train.of is None else f"{train.samples:,} of {train.of:,} samples"
    return key, f"{train.loss:.4f} at step {step}, in evaluation mode ({samples})"


def describe_epoch(result: RunResult) -> str:
    """How the epoch's samples were used: each once, and what happened to an uneven tail."""
    if result.streamed:   # a stream's length is known once a pass has reached its end
        if not result.train_samples:
            return "a stream; no pass reached its end, so its length is not known"
        return "a stream of " + _epoch_use(result).replace(" of each shuffled order", " of each pass")
    return _epoch_use(result)


def _epoch_use(result: RunResult) -> str:
    used = result.train_samples - result.dropped_per_epoch
    if result.dropped_per_epoch:
        return (f"{used:,} of {result.train_samples:,} samples in {result.steps_per_epoch} steps, no padding; "
                f"the last {result.dropped_per_epoch} of each shuffled order dropped")
    text = f"{used:,} samples in {result.steps_per_epoch} steps, each once, no padding"
    if result.steps_per_epoch * result.last_step_samples != used:
        text += f" (last step {result.last_step_samples}, {batch_split_of(result.strategy)})"
    return text


def describe_checkpoints(result: RunResult) -> str:
    """How many checkpoints were written, what they cost, where the last one is, and the resume source."""
    if not result.checkpoints_written:
        text = "none written"
    else:
        text = f"{result.checkpoints_written} written ({format_seconds(result.checkpoint_s)})"
        if result.checkpoint_background_s:   # --async-checkpoint: training paused that long, the writes took this
            text = (f"{result.checkpoints_written} written in the background ({format_seconds(result.checkpoint_s)} "
                    f"of training, writes {format_seconds(result.checkpoint_background_s)})")
        if result.last_checkpoint is not None:
            text += f", last {result.last_checkpoint}"
    if result.resumed_from is not None:
        text += f"; resumed from {result.resumed_from}"
    return text


def _wall_time(result: RunResult) -> str:
    """This process's wall time and the training time; a resumed run's training time counts its
    earlier runs too (as its steps and samples do), which is said, or it could exceed the wall time."""
    over = " over every run since the first" if result.resumed_from is not None else ""
    return f"{format_seconds(result.wall_s)} (training {format_seconds(result.train_s)}{over})"
