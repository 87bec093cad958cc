"""``scaleloop plot RUN [RUN ...]``: several runs' training curves on one picture (loss by step
and by wall time, throughput), to compare 1 process against N, or two settings."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from scaleloop.errors import UsageError

if TYPE_CHECKING:
    from scaleloop.output.plot_runs import Curves


def register(subparsers: Any) -> None:
    """Add ``plot RUN [RUN ...]`` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plot", help="compare runs on one picture: loss by step and by wall time, throughput",
        description="Draw the training loss of each run directory against the step and against wall time, "
                    "and its throughput, on one picture: 1 process against N, or two settings.")
    parser.add_argument("runs", metavar="RUN", nargs="+", help="run directories (the --out of each run)")
    parser.add_argument("--out", metavar="FILE", default="compare.png", help="the picture to write (default: compare.png)")


def _config(run_dir: Path) -> dict[str, Any]:
    """The run's saved settings (flat), or none without a readable ``config.toml``."""
    from scaleloop.config import load_toml

    try:
        return dict(load_toml(run_dir / "config.toml"))
    except UsageError:
        return {}


def label_of(run_dir: Path) -> str:
    """``<dir name> (<strategy> x <processes>)`` from the run's ``config.toml`` (the name alone without one)."""
    config = _config(run_dir)
    if not config:
        return run_dir.name
    world = int(config.get("nproc", 1) or 1) * int(config.get("nnodes", 1) or 1)
    strategy = config.get("strategy", "auto")
    return f"{run_dir.name} ({strategy} x {world})"


def curves_of(name: str) -> tuple["Curves", Optional[str]]:
    """Run ``name``'s curves, and a note when they are not its log rows: a finished run of fewer
    steps than its ``--log-every`` has no log row, and is drawn from the loss at each epoch's end
    (or where it stopped). One line, exit 2, for a directory with neither."""
    from scaleloop.output.plot_runs import END_ROWS, Curves

    run_dir = Path(name)
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        raise UsageError(f"{name!r} has no metrics.csv: give run directories (the --out of a run)")
    label = label_of(run_dir)
    curves = Curves.read(metrics, label)
    if curves.step:
        return curves, None
    curves = Curves.read(metrics, label, kinds=END_ROWS)
    if not curves.step:
        raise UsageError(f"{name!r} logged no training step yet (metrics.csv has no step, epoch or stop row); "
                         "nothing to draw")
    log_every = _config(run_dir).get("log_every")
    fewer = f"fewer than --log-every {log_every}" if log_every else "fewer than its --log-every"
    points = f"{len(curves.step)} point{'s' if len(curves.step) > 1 else ''}"
    return curves, (f"note: {name!r} logged no step row (its {int(curves.step[-1])} steps are {fewer}): drawn from "
                    f"the mean loss at each epoch's end or where it stopped ({points})")


def run(args: argparse.Namespace) -> int:
    from scaleloop.output import profile_summary
    from scaleloop.output.plot_runs import plot_runs

    read = [curves_of(name) for name in args.runs]
    try:
        written = plot_runs([curves for curves, _ in read], Path(args.out))
    except ImportError:
        raise UsageError("scaleloop plot needs matplotlib: pip install matplotlib") from None
    print(f"wrote {written}: {len(read)} run(s), loss by step and by wall time, throughput")
    for _, note in read:
        if note is not None:
            print(note)
    for name in args.runs:   # a --profile run's summary and timeline, as the run printed them
        summary = profile_summary.read(Path(name))
        if summary is not None:
            print(f"{name}:")
            print("\n".join(profile_summary.lines(summary, Path(name) / profile_summary.PROFILE_DIR)))
    return 0
