"""``scaleloop plot``: runs' curves on one picture, and its one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.cli import main
from scaleloop.commands.plot import label_of
from scaleloop.output.compare import Curves

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
