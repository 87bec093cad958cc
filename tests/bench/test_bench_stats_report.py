"""Measurement summaries, hardware names, and the JSON + markdown + PNG a report is written as."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleloop.bench.hardware import hardware_line, hardware_slug
from scaleloop.bench.report import BenchReport, Column, Table, fmt_bytes, fmt_flops, write_report
from scaleloop.bench.stats import interval_union, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU_HW = {"cpu": "Some CPU", "cores": 2, "torch": "2.13.0", "python": "3.11", "gpus": [], "mps_available": False,
          "load_1m": 1.9}


def test_summarize_median_and_spread() -> None:
    s = summarize([3.0, 1.0, 2.0, 100.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 4
    assert s["spread"] == pytest.approx(99 / 2.5)
    with pytest.raises(ValueError):
        summarize([])


def test_interval_union_counts_overlaps_once() -> None:
    assert interval_union([]) == 0.0
    assert interval_union([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert interval_union([(0, 10), (1, 2), (3, 4)]) == pytest.approx(10.0)


def test_hardware_slug_and_line() -> None:
    assert hardware_slug(CPU_HW, "cpu") == "cpu-2core"
    gpu_hw = dict(CPU_HW, gpus=[{"index": 0, "name": "NVIDIA H100 80GB HBM3"}] * 8)
    assert hardware_slug(gpu_hw, "cuda") == "8xh100-80gb-hbm3"
    assert hardware_slug(gpu_hw, "cpu") == "cpu-2core"   # a CPU benchmark on a GPU machine
    assert "no GPU" in hardware_line(CPU_HW)
    assert "H100" in hardware_line(gpu_hw)


def test_formatters() -> None:
    assert fmt_bytes(16_826_408) == "16.83 MB" and fmt_bytes(12) == "12 B"
    assert fmt_flops(2.5e12) == "2.5 TFLOP"


def _report(quick: bool) -> BenchReport:
    table = Table("T", [Column("a", "A"), Column("b", "B", lambda v: f"{v:.2f}")],
                  [{"a": "x|y", "b": 1.234}, {"a": "z", "b": None}], caption="cap")
    return BenchReport(what="demo", title="Demo", hardware=CPU_HW, slug="cpu-2core", command="scaleloop bench demo",
                       settings={}, tables=[table], headline="head", notes=["n1"],
                       data={"nan": float("nan"), "inf": float("inf")}, quick=quick, date="2026-01-02")


def test_write_report_files(tmp_path: Path) -> None:
    def plot(report: BenchReport, path: Path) -> Path:
        path.write_bytes(PNG_MAGIC)
        return path

    paths = write_report(_report(quick=True), tmp_path / "out", plot)
    assert {p.name for p in paths.values()} == {f"2026-01-02_cpu-2core_demo-quick.{e}" for e in ("json", "md", "png")}
    data = json.loads(paths["json"].read_text())          # strict JSON: NaN and inf became null
    assert data["data"] == {"nan": None, "inf": None}
    assert data["tables"][0]["rows"][0]["b"] == 1.234 and data["quick"] is True
    md = paths["md"].read_text()
    assert "| A | B |" in md and "| x/y | 1.23 |" in md and "| z | - |" in md
    assert "![demo](2026-01-02_cpu-2core_demo-quick.png)" in md
    assert "load average when the benchmark started: 1.90 over 2 cores" in md
    assert "other processes were running" in md           # 1.9 > half the cores


def test_report_without_a_chart(tmp_path: Path) -> None:
    paths = write_report(_report(quick=False), tmp_path, plot=lambda r, p: None)
    assert set(paths) == {"json", "md"}
    assert paths["md"].name == "2026-01-02_cpu-2core_demo.md"
    assert "![" not in paths["md"].read_text()


def test_tag_keeps_runs_of_one_command_apart() -> None:
    report = _report(quick=False)
    report.tag = "convnet"
    assert report.stem == "2026-01-02_cpu-2core_demo-convnet"
    report.quick = True
    assert report.stem == "2026-01-02_cpu-2core_demo-convnet-quick"


def test_index_lists_real_results_only(tmp_path: Path) -> None:
    from scaleloop.bench.index import write_index

    write_report(_report(quick=False), tmp_path)
    write_report(_report(quick=True), tmp_path)
    (tmp_path / "notes.json").write_text("[1, 2]")          # not a result: ignored
    text = write_index(tmp_path).read_text()
    assert "2026-01-02_cpu-2core_demo.md" in text
    assert "-quick" not in text
    assert "| 2026-01-02 | cpu-2core | Demo | head |" in text
    assert "No GPU results yet" in text


def test_index_lists_current_results_notes_and_points_at_history(tmp_path: Path) -> None:
    from scaleloop.bench.index import write_index

    write_report(_report(quick=False), tmp_path)
    (tmp_path / "2026-01-03_cpu-2core_launch.md").write_text("# Launch time, by hand\n\ntext\n")
    (tmp_path / "notes.md").write_text("# not a dated result: ignored\n")
    history = tmp_path / "history"
    history.mkdir()
    old = _report(quick=False)
    old.tag = "first"
    write_report(old, history)
    text = write_index(tmp_path).read_text()
    assert "| 2026-01-03 | cpu-2core | Launch time, by hand | [md](2026-01-03_cpu-2core_launch.md) |" in text
    assert "notes.md" not in text and "demo-first" not in text
    assert "1 earlier run that a result above replaced" in text and "[history/](history/README.md)" in text
    past = (history / "README.md").read_text()
    assert "# Superseded benchmark results" in past and "[md](2026-01-02_cpu-2core_demo-first.md)" in past
    assert "history/README.md" not in past
