"""The picture of a verify run: the loss of 1 process and of N per step, and how far apart their
weights are (relative to the largest weight) against the tolerance, on a log axis."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from scaleloop.verify.compare import StepDiff, Tolerance


def plot_verify(rows: Sequence[StepDiff], tol: Tolerance, world: int, strategy: str, png_path: Path) -> Path:
    """Draw ``rows`` into ``png_path``. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in rows]
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    loss, diff = fig.subplots(1, 2)
    loss.plot(steps, [r.loss_ref for r in rows], marker="o", label="1 process")
    loss.plot(steps, [r.loss_run for r in rows], marker="x", linestyle="--", label=f"{world} processes ({strategy})")
    loss.set_title("Loss per step")
    loss.set_ylabel("loss")
    loss.legend()
    # A difference of exactly 0 has no place on a log axis: drawn at a floor far below the tolerance.
    floor = tol.params * 1e-4
    diff.plot(steps, [max(r.raw_param_rel, floor) for r in rows], marker="o", label="parameters (all elements)")
    diff.plot(steps, [max(r.param_rel, floor) for r in rows], marker=".", label="parameters compared")
    diff.plot(steps, [max(r.grad_rel, floor) for r in rows], marker="^", linestyle=":", label="gradients")
    diff.axhline(tol.params, color="tab:red", linewidth=1, label=f"tolerance {tol.params:.0e}")
    diff.set_yscale("log")
    diff.set_title(f"|1 process - {world} processes|, relative to the largest value")
    diff.set_ylabel("relative difference")
    diff.legend(fontsize="small")
    for ax in (loss, diff):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path
