"""What the loop prints: the run's header, the progress bar, the lines after an evaluation.

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
from scaleloop.loop.build import Run
from scaleloop.loop.evaluate import EvalResult
from scaleloop.loop.schedule import describe_schedule
from scaleloop.loop.tasks import describe_task
from scaleloop.runtime.devices import describe_device
from scaleloop.runtime.dist import restart_count

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
    where it is known (``loop.throughput``)."""
    norm = f", grad norm {grad_norm:.3g}" if grad_norm is not None else ""
    speed = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s is not None else f"{samples_per_s:,.0f} samples/s"
    share = f", MFU {mfu:.1%}" if mfu is not None else ""
    return f"loss {loss:.4f} (last {steps} step{'s' if steps != 1 else ''}){norm}, {speed}{share}"


def announce(run: Run, resumed: Optional[Resumed], say: Log) -> None:
    """The run's header: what trains on what, how, and where it continues from."""
    cfg, env, data, sampler = run.cfg, run.env, run.data, run.loader.sampler
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
    if sampler.dropped_per_epoch:
        say(f"note: the last {sampler.dropped_per_epoch} sample(s) of each shuffled epoch are dropped "
            f"({'--drop-last' if cfg.drop_last else 'too few to give every worker and micro-step one'})")
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
    steps_done = cfg.max_steps is not None and at.global_step >= cfg.max_steps
    epochs_done = at.epoch >= cfg.epochs
    if not (steps_done or epochs_done):
        return False
    where, flags = f"the run already reached step {at.global_step}", []
    if steps_done:
        where += f" (--max-steps {cfg.max_steps})"
        flags.append("--max-steps")
    if epochs_done:
        at_end = at.epoch == cfg.epochs and at.step_in_epoch == 0
        where += f", {'the end' if at_end else 'past the end'} of epoch {cfg.epochs} (--epochs {cfg.epochs})"
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
