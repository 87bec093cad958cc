"""``scaleloop plot``: runs' curves on one picture, and its one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleloop.cli import main
from scaleloop.commands.plot import label_of
from scaleloop.output import profile_summary
from scaleloop.output.plot_runs import END_ROWS, Curves
from scaleloop.output.profile_trace import analyse

HEADER = "kind,epoch,step,samples,train_loss,test_loss,test_acc,lr,samples_per_s,wall_s\n"


def _run(root: Path, name: str, nproc: int, losses: list[float]) -> Path:
    run = root / name
    run.mkdir()
    (run / "config.toml").write_text(f'model = "simplenet"\nstrategy = "ddp"\nnproc = {nproc}\n')
    rows = [f"step,1,{10 * (i + 1)},{640 * (i + 1)},{loss},,,0.01,{1000.0 * nproc},{0.5 * (i + 1) / nproc}\n"
            for i, loss in enumerate(losses)]
    (run / "metrics.csv").write_text(HEADER + "".join(rows) + "epoch,1,30,1920,0.5,0.6,0.9,0.01,,\n")
    return run


def test_runs_are_drawn_on_one_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one, two = _run(tmp_path, "one", 1, [1.0, 0.6, 0.4]), _run(tmp_path, "two", 2, [1.0, 0.6, 0.4])
    curves = Curves.read(two / "metrics.csv", label_of(two))
    assert curves.label == "two (ddp x 2)" and curves.step == [10.0, 20.0, 30.0]   # the step rows only
    assert curves.wall_s == [0.25, 0.5, 0.75] and curves.samples_per_s == [2000.0] * 3
    png = tmp_path / "compare.png"
    assert main(["plot", str(one), str(two), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.startswith(f"wrote {png}: 2 run(s)")


def test_what_is_not_a_run_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no metrics.csv" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.csv").write_text(HEADER)
    assert main(["plot", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "logged no training step yet" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def _short_profiled_run(root: Path) -> Path:
    """A finished 6-step run with --log-every 10 and --profile 1: metrics.csv has its ``stop`` row
    only (no step reached a log row), and profile/summary.json as the run wrote it."""
    run = root / "short"
    (run / "profile").mkdir(parents=True)
    (run / "config.toml").write_text('[model_data]\nmodel = "simplenet"\n[output]\nlog_every = 10\nprofile = 1\n')
    (run / "metrics.csv").write_text(HEADER + "stop,1,6,384,0.5646,0.4358,0.869,0.01,7891.8,1.19\n")
    step = {"ph": "X", "name": "scaleloop.step", "ts": 0, "dur": 1000, "tid": 1, "pid": 1, "cat": "user_annotation"}
    addmm = {"ph": "X", "name": "aten::addmm", "ts": 100, "dur": 300, "tid": 1, "pid": 1, "cat": "cpu_op"}
    trace = run / "profile" / "rank-0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": [step, addmm]}))
    profile_summary.write(run / "profile", profile_summary.combine([analyse(trace)], first_step=3))
    return run


def test_a_run_shorter_than_log_every_is_drawn_from_its_end_row_with_its_profile(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = _short_profiled_run(tmp_path)
    png = tmp_path / "compare.png"
    assert main(["plot", str(short), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {png}: 1 run(s), loss by step and by wall time, throughput"
    # One line says what is missing and what was drawn instead.
    assert out[1] == (f"note: {str(short)!r} logged no step row (its 6 steps are fewer than --log-every 10): "
                      "drawn from the mean loss at each epoch's end or where it stopped (1 point)")
    # The profile summary the docs promise, as the run printed it.
    assert out[2] == f"{short}:" and out[3].startswith("profile: 1 step(s) (step 3) on 1 rank(s)")
    assert any(line.startswith("  top operators, rank 0 (self ms per step): aten::addmm") for line in out)
    curves = Curves.read(short / "metrics.csv", "short", kinds=END_ROWS)
    assert curves.step == [6.0] and curves.loss == [0.5646] and curves.wall_s == [1.19]
