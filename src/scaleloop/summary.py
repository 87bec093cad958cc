"""The end-of-run summary that ``scaleloop train`` prints."""
from __future__ import annotations

from scaleloop.loop import RunResult
from scaleloop.metrics import format_rate, format_seconds, format_summary


def format_result(result: RunResult) -> str:
    """The run's key facts, one per line, aligned."""
    test = result.test
    rows = [
        ("device", result.device),
        ("strategy", result.strategy),
        ("world size", str(result.world_size)),
        ("precision", result.precision),
        ("epochs", f"{result.epochs} ({result.steps} steps, {result.samples:,} samples)"),
        ("final train loss", f"{result.train_loss:.4f}"),
        ("test accuracy", f"{test.accuracy:.2%} (test loss {test.loss:.4f}, {test.samples:,} samples)" if test else "no test set"),
        ("throughput", format_rate(result.samples_per_s)),
        ("wall time", f"{format_seconds(result.wall_s)} (training {format_seconds(result.train_s)})"),
    ]
    if result.dropped_per_epoch:
        rows.append(("dropped per epoch", f"{result.dropped_per_epoch} sample(s) (see --drop-last)"))
    rows.append(("run directory", str(result.run_dir) if result.run_dir else "-"))
    return "summary\n" + format_summary(rows)
