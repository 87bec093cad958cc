"""The picture of a verify comparison (``--plot``)."""
from __future__ import annotations

from pathlib import Path

from scaleloop.verify.compare import StepDiff, tolerance_for
from scaleloop.verify.plot import difference_lines, plot_verify
from scaleloop.verify.report import equivalence_verdict


def test_the_comparison_is_drawn_with_exact_zeros_on_the_log_axis(tmp_path: Path) -> None:
    rows = [StepDiff(step, 2.0 / step, 2.0 / step + 1e-7, 0.0 if step == 1 else 1e-8, 0.0 if step == 1 else 1e-8,
                     "w", 1e-7, "w", raw_param_rel=0.0 if step == 1 else 2e-8) for step in (1, 2, 3)]
    png = plot_verify(rows, tolerance_for("fp32", None, "sgd", 0.1), 2, "ddp", tmp_path / "sub" / "verify.png")
    assert png == tmp_path / "sub" / "verify.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_pass_draws_no_judged_difference_above_the_line() -> None:
    # Issue 41.11: a PASS whose parameters with all elements (some left out for rounding-level
    # gradients) stood above the parameters' tolerance at step 1, and whose gradients (tolerance
    # 1e-4) stood above the parameters' line (1e-5), with no word on why.
    tol = tolerance_for("fp32", None, "adam", 0.01).per_step()
    rows = [StepDiff(1, 2.3, 2.3, 1.5e-5, 8e-5, "body.bias", 5e-5, "body.weight", raw_param_rel=3e-4, excluded=4,
                     excluded_in=("body.bias",)),
            StepDiff(2, 2.2, 2.2, 1e-8, 5e-8, "head.weight", 2e-5, "head.weight")]
    passed, verdict = equivalence_verdict(rows, 2, 2, "ddp", tol, False)
    assert passed, verdict
    lines = dict(difference_lines(rows, tol))
    judged = {label: shares for label, shares in lines.items() if "not judged" not in label}
    assert set(judged) == {"loss", "parameters", "gradients"}
    assert all(share <= 1 for shares in judged.values() for share in shares), judged
    assert judged["parameters"][0] < 1 < 8e-5 / tol.params   # within Adam's share of lr: said by the line
    unjudged = [label for label in lines if "not judged" in label]
    assert unjudged == ["parameters, all elements (not judged: 4 with rounding-level gradients left out)"]
    assert lines[unjudged[0]][0] > 1


def test_a_judged_difference_is_above_the_line_exactly_where_the_step_fails() -> None:
    tol = tolerance_for("fp32")
    rows = [StepDiff(1, 2.3, 2.3, 1e-6, 2e-6, "w", 5e-4, "w", buffer_abs=1e-3, buffer_rel=1e-3, worst_buffer="ema"),
            StepDiff(2, 2.2, 2.3, 1e-3, 1e-3, "w", 1e-6, "w", buffer_abs=1e-9, buffer_rel=1e-9, worst_buffer="ema")]
    lines = dict(difference_lines(rows, tol))
    for row, i in zip(rows, range(2)):
        above = {label for label, shares in lines.items() if shares[i] > 1}
        failed = {f.split(" ")[0] for f in row.failures(tol)}
        assert {label.split(" ")[0] for label in above} == failed, (row.step, above, row.failures(tol))
