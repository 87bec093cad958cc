"""A benchmark result as three files with one stem: JSON (everything), markdown (the tables), PNG.

File names say when and on what: ``<date>_<hardware>_<what>.{json,md,png}``, with ``-quick``
appended for CI-sized runs, so that a quick run never overwrites a real result.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from scaleloop.bench.hardware import hardware_line, load_line

Formatter = Callable[[Any], str]


@dataclass(frozen=True)
class Column:
    """One table column: the row key, the header, and how to print a value."""

    key: str
    header: str
    fmt: Optional[Formatter] = None

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if self.fmt is not None and not isinstance(value, str):
            return self.fmt(value)
        return str(value)


@dataclass
class Table:
    title: str
    columns: Sequence[Column]
    rows: list[dict[str, Any]]
    caption: str = ""

    def markdown(self) -> str:
        """The table as GitHub markdown, preceded by its title and followed by its caption."""
        head = "| " + " | ".join(c.header for c in self.columns) + " |"
        rule = "| " + " | ".join("---" for _ in self.columns) + " |"
        body = ["| " + " | ".join(c.cell(r).replace("|", "/") for c in self.columns) + " |" for r in self.rows]
        parts = [f"### {self.title}", "", head, rule, *body]
        if self.caption:
            parts += ["", self.caption]
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": [c.key for c in self.columns], "rows": self.rows}


@dataclass
class BenchReport:
    """Everything one bench command measured, ready to be written and printed."""

    what: str                       # devices | scaling | strategies | overhead | mfu
    title: str
    hardware: dict[str, Any]
    slug: str                       # hardware name for the file name: cpu-2core, 1xh100-...
    command: str
    settings: dict[str, Any]
    tables: list[Table]
    headline: str = ""
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    quick: bool = False
    tag: str = ""                   # told apart from other runs of the same command: "convnet"
    date: str = field(default_factory=lambda: _dt.date.today().isoformat())

    @property
    def stem(self) -> str:
        return (f"{self.date}_{self.slug}_{self.what}" + (f"-{self.tag}" if self.tag else "")
                + ("-quick" if self.quick else ""))

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "title": self.title, "date": self.date, "quick": self.quick,
                "hardware": self.hardware, "hardware_slug": self.slug, "command": self.command,
                "settings": self.settings, "headline": self.headline,
                "tables": [t.to_json() for t in self.tables], "notes": self.notes, "data": self.data}

    def markdown(self, png_name: Optional[str] = None) -> str:
        lines = [f"# {self.title}", "",
                 f"- date: {self.date}" + (" (--quick: CI-sized, not a result to quote)" if self.quick else ""),
                 f"- hardware: {hardware_line(self.hardware)}",
                 f"- command: `{self.command}`"]
        load = load_line(self.hardware)
        if load:
            lines.append(f"- {load}")
        if self.headline:
            lines += ["", f"**{self.headline}**"]
        for table in self.tables:
            lines += ["", table.markdown()]
        if png_name:
            lines += ["", f"![{self.what}]({png_name})"]
        if self.notes:
            lines += ["", "### Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def terminal(self) -> str:
        """What the command prints at the end: headline and tables (markdown reads fine as text)."""
        parts = [t.markdown() for t in self.tables]
        if self.headline:
            parts.append(self.headline)
        return "\n\n".join(parts)


def write_report(report: BenchReport, out_dir: Path,
                 plot: Optional[Callable[[BenchReport, Path], Optional[Path]]] = None) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (when matplotlib is there) ``<stem>.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    png = out_dir / f"{report.stem}.png"
    if plot is not None and plot(report, png) is not None:
        paths["png"] = png
    paths["json"] = out_dir / f"{report.stem}.json"
    paths["json"].write_text(json.dumps(_clean(report.to_json()), indent=2) + "\n", encoding="utf-8")
    paths["md"] = out_dir / f"{report.stem}.md"
    paths["md"].write_text(report.markdown(png.name if "png" in paths else None), encoding="utf-8")
    return paths


def _clean(obj: Any) -> Any:
    """JSON has no NaN or infinity: write them as null rather than as invalid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


# --- formatters shared by the bench tables ---------------------------------------------------

def fmt_int(v: float) -> str:
    return f"{int(round(v)):,}"


def fmt_rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def fmt_ratio(v: float) -> str:
    return f"{v:.2f}"


def fmt_pct(v: float) -> str:
    return f"{100 * v:.1f}%" if abs(v) >= 0.001 else f"{100 * v:.3f}%"


def fmt_ms(v: float) -> str:
    return f"{1e3 * v:.2f}" if v < 0.1 else f"{1e3 * v:.1f}"


def fmt_bytes(v: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:.2f} {unit}"
    return f"{int(v)} B"


def fmt_flops(v: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if v >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.3g} FLOP"
