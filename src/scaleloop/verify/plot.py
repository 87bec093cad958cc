"""The picture of a verify run: the loss of 1 process and of N per step, and every difference the
verdict judges as a share of its own tolerance, on a log axis, against one line at 1.

Each quantity has a tolerance of its own (the gradients' is not the parameters', and under Adam
parameters also pass within a share of ``lr``), so the picture draws each as the share of what it
is allowed: a point at or under the line is one the verdict counts as equal, and a PASS shows none
above it. A difference that is not judged (the parameters with the elements left out for
rounding-level gradients) is drawn only with a label that says so.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from scaleloop.verify.compare import StepDiff, Tolerance

#: A share of exactly 0 has no place on a log axis: drawn at this floor, far below the line.
FLOOR = 1e-4


def _share(value: float, limit: float) -> float:
    """``value`` as a share of ``limit`` (inf for NaN: a NaN is never equal)."""
    if math.isnan(value):
        return math.inf
    return value / limit if limit > 0 else (0.0 if value == 0 else math.inf)


def params_share(tol: Tolerance, step: int, diff: float, rel: float) -> float:
    """Parameters ``diff`` apart (``rel`` of the largest weight) as a share of what ``tol`` allows
    after ``step``: at most 1 exactly when :meth:`Tolerance.params_equal` holds."""
    share = _share(rel, tol.params)
    allowance = tol.adaptive_allowance(step)
    return min(share, _share(diff, allowance)) if tol.adaptive_lr is not None and allowance > 0 else share


def difference_lines(rows: Sequence[StepDiff], tol: Tolerance) -> list[tuple[str, list[float]]]:
    """The right panel's lines: ``(label, share of the tolerance per row)``, each judged as
    :meth:`StepDiff.failures` judges it; buffers and optimizer state only where some differ, and the
    parameters with every element only where elements were left out, labelled not judged."""
    lines = [("loss", [_share(r.loss_rel, tol.loss) for r in rows]),
             ("parameters", [params_share(tol, r.step, r.param_abs, r.param_rel) for r in rows]),
             ("gradients", [_share(r.grad_rel, tol.grads_at(r.step)) for r in rows])]
    if any(r.buffer_abs or r.buffer_rel for r in rows):
        lines.append(("buffers", [min(params_share(tol, r.step, r.buffer_abs, r.buffer_rel),
                                      _share(r.buffer_abs, r.buffer_allowance)) for r in rows]))
    if any(r.state_rel for r in rows):
        lines.append(("optimizer state", [_share(r.state_rel, tol.state) for r in rows]))
    left_out = max((r.excluded for r in rows), default=0)
    if left_out:
        lines.append((f"parameters, all elements (not judged: {left_out} with rounding-level gradients left out)",
                      [_share(r.raw_param_rel, tol.params) for r in rows]))
    return lines


def plot_verify(rows: Sequence[StepDiff], tol: Tolerance, world: int, strategy: str, png_path: Path) -> Path:
    """Draw ``rows`` into ``png_path``. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in rows]
    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)
    loss, diff = fig.subplots(1, 2)
    loss.plot(steps, [r.loss_ref for r in rows], marker="o", label="1 process")
    loss.plot(steps, [r.loss_run for r in rows], marker="x", linestyle="--", label=f"{world} processes ({strategy})")
    loss.set_title("Loss per step")
    loss.set_ylabel("loss")
    loss.legend()
    for (label, shares), marker in zip(difference_lines(rows, tol), "osx^Dv"):
        judged = "not judged" not in label
        diff.plot(steps, [min(max(s, FLOOR), 1e6) for s in shares], marker=marker, label=label,
                  linestyle="-" if judged else ":", alpha=1.0 if judged else 0.6)
    diff.axhline(1.0, color="tab:red", linewidth=1, label="tolerance (at or under the line: equal)")
    diff.set_yscale("log")
    diff.set_title(f"|1 process - {world} processes| / its tolerance")
    diff.set_ylabel("share of the tolerance")
    # Below the axes: a label that says why a line is not judged is long.
    diff.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    for ax in (loss, diff):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path
