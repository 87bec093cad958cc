"""The picture of a verify comparison (``--plot``)."""
from __future__ import annotations

from pathlib import Path

from scaleloop.verify.compare import StepDiff, tolerance_for
from scaleloop.verify.plot import plot_verify


def test_the_comparison_is_drawn_with_exact_zeros_on_the_log_axis(tmp_path: Path) -> None:
    rows = [StepDiff(step, 2.0 / step, 2.0 / step + 1e-7, 0.0 if step == 1 else 1e-8, 0.0 if step == 1 else 1e-8,
                     "w", 1e-7, "w", raw_param_rel=0.0 if step == 1 else 2e-8) for step in (1, 2, 3)]
    png = plot_verify(rows, tolerance_for("fp32", None, "sgd", 0.1), 2, "ddp", tmp_path / "sub" / "verify.png")
    assert png == tmp_path / "sub" / "verify.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
