"""The PNG chart of each bench report. matplotlib is imported here only, when a chart is drawn.

Each function takes the report and the PNG path and returns the path, or None when
matplotlib is not installed (the JSON and markdown are written regardless).
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional

from scaleloop.bench.report import BenchReport


def _figure(ncols: int, width: float = 5.0, height: float = 4.2) -> Optional[tuple[Any, Any]]:
    try:
        # Figure + the Agg canvas: no pyplot global state, no GUI backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(width * ncols, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _save(fig: Any, report: BenchReport, path: Path) -> Path:
    width = int(fig.get_figwidth() * 13)   # characters that fit across the figure at this font size
    title = textwrap.fill(report.title, width)
    fig.suptitle(f"{title}\n{report.date}, {report.slug}" + (" (quick)" if report.quick else ""), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_scaling(report: BenchReport, path: Path) -> Optional[Path]:
    """Throughput against ideal; step-time breakdown; the projection (marked as a model)."""
    made = _figure(3)
    if made is None:
        return None
    fig, (ax_rate, ax_steps, ax_model) = made
    points = report.data["points"]
    workers = [p["workers"] for p in points]
    rates = [p["samples_per_s"] for p in points]
    ideal = [rates[0] * n for n in workers]   # weak or strong: N workers ideally do N times the samples/s
    ax_rate.plot(workers, ideal, "--", color="grey", label="ideal (N x 1 worker)")
    ax_rate.plot(workers, rates, "o-", label="measured" + (" (median, min-max)" if "samples_per_s_min" in points[0]
                                                          and len(points[0].get("repetitions", [])) > 1 else ""))
    if all("samples_per_s_min" in p for p in points):
        low = [r - p["samples_per_s_min"] for r, p in zip(rates, points)]
        high = [p["samples_per_s_max"] - r for r, p in zip(rates, points)]
        ax_rate.errorbar(workers, rates, yerr=[low, high], fmt="none", capsize=4, color="C0")
    for n, r, p in zip(workers, rates, points):
        ax_rate.annotate(f"eff {p['efficiency']:.2f}", (n, r), textcoords="offset points", xytext=(-20, 8), fontsize=8)
    ax_rate.set_xlabel("workers")
    ax_rate.margins(x=0.15)
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_ylabel("samples/s")
    ax_rate.set_xticks(workers)
    ax_rate.set_title("Throughput")
    ax_rate.grid(True, alpha=0.3)
    ax_rate.legend(fontsize=8)

    bottoms = [0.0] * len(points)
    labels = [str(n) for n in workers]
    phases: tuple[tuple[str, str], ...] = (("data_s", "data wait"), ("forward_s", "forward"),
                                           ("backward_s", "backward (+comm)"), ("optimizer_s", "optimizer"))
    if all(p["breakdown"].get("backward_compute_s") is not None for p in points):
        # Backward split at its last all-reduce launch (bench/breakdown.py).
        phases = (phases[0], phases[1], ("backward_compute_s", "backward compute"),
                  ("wait_s", "waiting for slowest worker"), ("comm_exposed_s", "all-reduce not hidden"), phases[3])
    for key, name in phases:
        values = [(p["breakdown"].get(key) or 0.0) * 1e3 for p in points]
        ax_steps.bar(labels, values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax_steps.set_xlabel("workers")
    ax_steps.set_ylabel("ms per step")
    ax_steps.set_title("Step-time breakdown")
    ax_steps.legend(fontsize=8)

    model = report.data["model"]
    names = {i["key"]: i["name"] for i in model["interconnects"]}
    for key, name in names.items():
        rows = [r for r in model["projection"] if r["interconnect"] == key]
        xs = [r["workers"] for r in rows]
        line, = ax_model.plot(xs, [r["efficiency_overlap"] for r in rows], "o-", markersize=3, label=name)
        ax_model.plot(xs, [r["efficiency_no_overlap"] for r in rows], "--", color=line.get_color(), linewidth=1)
    ax_model.set_xscale("log", base=2)
    ax_model.set_xticks(xs, [str(x) for x in xs])
    ax_model.set_ylim(0, 1.05)
    ax_model.set_xlabel("GPUs")
    ax_model.set_ylabel("efficiency")
    ax_model.set_title("MODEL: projected efficiency\n(solid: overlap, dashed: none)", fontsize=10)
    ax_model.grid(True, alpha=0.3)
    ax_model.legend(fontsize=8)
    return _save(fig, report, path)


def _bars(report: BenchReport, path: Path, labels: list[str], values: list[float], ylabel: str,
          title: str, annotate: str = "{:,.0f}", texts: Optional[list[str]] = None) -> Optional[Path]:
    """A bar per label; ``texts`` (optional) replaces the number printed on each bar."""
    made = _figure(1, width=max(6.0, 1.2 * len(labels)))
    if made is None:
        return None
    fig, (ax,) = made
    labels = ["\n".join(textwrap.wrap(label, 14)) for label in labels]   # long labels must not run together
    bars = ax.bar(labels, values, color="tab:blue")
    for i, (bar, value) in enumerate(zip(bars, values)):
        text = texts[i] if texts and texts[i] else annotate.format(value)
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, report, path)


def plot_devices(report: BenchReport, path: Path) -> Optional[Path]:
    # Missing devices keep their place, marked, so every machine's chart has the same bars.
    rows = report.data["devices"]
    return _bars(report, path, [r["device"] for r in rows], [r.get("samples_per_s") or 0.0 for r in rows],
                 "samples/s (median)", "Same training on each device",
                 texts=["" if r.get("available") else "not available here" for r in rows])


def plot_strategies(report: BenchReport, path: Path) -> Optional[Path]:
    rows = [r for r in report.data["rows"] if r.get("samples_per_s")]
    return _bars(report, path, [r["label"] for r in rows], [r["samples_per_s"] for r in rows],
                 "samples/s", "Same workload, same global batch")


def plot_mfu(report: BenchReport, path: Path) -> Optional[Path]:
    rows = report.data["rows"]
    return _bars(report, path, [r["model"] for r in rows], [100 * r["mfu"] for r in rows],
                 "MFU (%)", "Model FLOPs utilisation", annotate="{:.1f}%")


def plot_overhead(report: BenchReport, path: Path) -> Optional[Path]:
    """Every repetition's training time, raw loop and scaleloop side by side, medians marked."""
    made = _figure(1, width=6.0)
    if made is None:
        return None
    fig, (ax,) = made
    reps = report.data["repetitions"]
    for i, (key, name) in enumerate((("raw_s", "raw PyTorch loop"), ("scaleloop_s", "scaleloop loop"))):
        values = [r[key] for r in reps]
        ax.scatter([i] * len(values), values, alpha=0.6)
        median = sorted(values)[len(values) // 2]
        ax.hlines(median, i - 0.25, i + 0.25, color="black")
    ax.set_xticks([0, 1], ["raw PyTorch loop", "scaleloop loop"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylabel("training seconds per repetition")
    ax.set_title(textwrap.fill(report.headline or "Overhead", 70), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, report, path)
