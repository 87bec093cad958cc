"""``scaleloop plot RUN [RUN ...]``: several runs' training curves on one picture (loss by step
and by wall time, throughput), to compare 1 process against N, or two settings."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scaleloop.errors import UsageError


def register(subparsers: Any) -> None:
    """Add ``plot RUN [RUN ...]`` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plot", help="compare runs on one picture: loss by step and by wall time, throughput",
        description="Draw the training loss of each run directory against the step and against wall time, "
                    "and its throughput, on one picture: 1 process against N, or two settings.")
    parser.add_argument("runs", metavar="RUN", nargs="+", help="run directories (the --out of each run)")
    parser.add_argument("--out", metavar="FILE", default="compare.png", help="the picture to write (default: compare.png)")


def label_of(run_dir: Path) -> str:
    """``<dir name> (<strategy> x <processes>)`` from the run's ``config.toml`` (the name alone without one)."""
    from scaleloop.config import load_toml

    try:
        config = load_toml(run_dir / "config.toml")
    except UsageError:
        return run_dir.name
    world = int(config.get("nproc", 1) or 1) * int(config.get("nnodes", 1) or 1)
    strategy = config.get("strategy", "auto")
    return f"{run_dir.name} ({strategy} x {world})"


def run(args: argparse.Namespace) -> int:
    from scaleloop.output.compare import Curves, plot_runs

    runs = []
    for name in args.runs:
        run_dir = Path(name)
        metrics = run_dir / "metrics.csv"
        if not metrics.is_file():
            raise UsageError(f"{name!r} has no metrics.csv: give run directories (the --out of a run)")
        curves = Curves.read(metrics, label_of(run_dir))
        if not curves.step:
            raise UsageError(f"{name!r} logged no training step yet (metrics.csv has no step row); nothing to draw")
        runs.append(curves)
    try:
        written = plot_runs(runs, Path(args.out))
    except ImportError:
        raise UsageError("scaleloop plot needs matplotlib: pip install matplotlib") from None
    print(f"wrote {written}: {len(runs)} run(s), loss by step and by wall time, throughput")
    from scaleloop.output import profile_summary
    for name in args.runs:   # a --profile run's summary and timeline, as the run printed them
        summary = profile_summary.read(Path(name))
        if summary is not None:
            print(f"{name}:")
            print("\n".join(profile_summary.lines(summary, Path(name) / profile_summary.PROFILE_DIR)))
    return 0
