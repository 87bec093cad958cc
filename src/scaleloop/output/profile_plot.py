"""The profile's picture, ``<run>/profile/timeline.png``: one row per rank, its profiled steps
coloured by part (``profile_trace.PARTS``), the communication that computing hid drawn as a thin
bar above, and each step's start as a tick, so that a straggler or an exposed all-reduce shows at
a glance. Each rank's time starts at its own first profiled step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from scaleloop.output.profile_trace import PARTS

_COLOURS = {"comm exposed": "#d62728", "data wait": "#ff7f0e", "optimizer": "#9467bd",
            "backward": "#1f77b4", "forward": "#2ca02c", "other": "#c7c7c7"}


def plot_timeline(summary: dict[str, Any], path: Path) -> Path:
    """Draw ``summary``'s ranks into ``path`` (PNG); raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = summary["ranks"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.8 * len(ranks)))
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for part in PARTS:
            bars = [(start, end - start) for p, start, end in rank["segments"] if p == part]
            if bars:
                ax.broken_barh(bars, (y - 0.3, 0.5), facecolors=_COLOURS[part], linewidth=0)
        if rank["overlapped"]:
            ax.broken_barh([(s, e - s) for s, e in rank["overlapped"]], (y + 0.22, 0.1),
                           facecolors="#8c564b", linewidth=0)
        for start in rank["step_starts_ms"]:
            ax.plot([start, start], [y - 0.38, y + 0.38], color="black", linewidth=0.8)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in reversed(ranks)])
    ax.set_xlabel("ms since the rank's first profiled step")
    ax.set_title(f"{summary.get('strategy', '')} x {len(ranks)}: profiled steps by part; "
                 f"slowest {summary['slowest']['text']}", fontsize=8)
    handles = [Patch(color=_COLOURS[p], label=p) for p in PARTS]
    handles.append(Patch(color="#8c564b", label="comm overlapped (thin)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(ranks) < 3 else -0.15),
              ncol=4, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
