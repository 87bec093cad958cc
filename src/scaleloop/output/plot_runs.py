"""Several runs on one picture (``scaleloop plot``): the training loss against the step and
against wall time, and the throughput, read from each run's ``metrics.csv``.

One process against N, or two settings: the loss against the step says whether they train the
same model; against wall time, which gets there first; the throughput, by how much.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from scaleloop.output.metrics import read_metrics

#: The rows of a run's ends: each epoch's, and the one where a run stopped inside an epoch.
END_ROWS = ("epoch", "stop")


@dataclass
class Curves:
    """One run's logged step rows (``kind`` "step" in ``metrics.csv``), or other rows of a loss."""

    label: str
    step: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)

    @classmethod
    def read(cls, metrics_csv: Path, label: str, kinds: Sequence[str] = ("step",)) -> "Curves":
        """The rows of ``kinds`` (log rows by default; :data:`END_ROWS`: the loss at each epoch's end)
        of ``metrics_csv`` that hold a loss (an empty :class:`Curves` if none)."""
        curves = cls(label)
        for row in read_metrics(metrics_csv):
            if row.get("kind") not in kinds or not row.get("train_loss") or not row.get("step"):
                continue
            curves.step.append(float(row["step"]))
            curves.loss.append(float(row["train_loss"]))
            curves.wall_s.append(float(row["wall_s"]) if row.get("wall_s") else float("nan"))
            curves.samples_per_s.append(float(row["samples_per_s"]) if row.get("samples_per_s") else float("nan"))
        return curves


def plot_runs(runs: Sequence[Curves], png_path: Path, title: Optional[str] = None) -> Path:
    """Draw ``runs`` side by side into ``png_path``: loss against step, loss against wall time,
    samples/s against step. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5))
    FigureCanvasAgg(fig)
    by_step, by_time, rate = fig.subplots(1, 3)
    for curves in runs:
        marker = "o" if len(curves.step) < 2 else None   # a line of one point is not drawn: its marker is
        by_step.plot(curves.step, curves.loss, label=curves.label, marker=marker)
        by_time.plot(curves.wall_s, curves.loss, label=curves.label, marker=marker)
        rate.plot(curves.step, curves.samples_per_s, label=curves.label, marker=marker)
    for ax, (title_, xlabel, ylabel) in zip((by_step, by_time, rate), (
            ("Training loss by step", "step", "train loss (log window)"),
            ("Training loss by wall time", "seconds since the run started", "train loss (log window)"),
            ("Throughput", "step", "samples/s (all ranks)"))):
        ax.set_title(title_)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    by_step.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path
