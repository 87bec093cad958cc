"""The end-of-run summary that ``scaleloop train`` prints."""
from __future__ import annotations

from typing import Optional

from scaleloop.loop.evaluate import EvalResult
from scaleloop.loop.result import RunResult
from scaleloop.output.memory import format_table, summary_line
from scaleloop.output.metrics import format_rate, format_seconds, format_summary
from scaleloop.strategies import batch_split_of


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
