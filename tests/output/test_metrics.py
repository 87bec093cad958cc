"""Tests for scaleloop.output.metrics: CSV/TensorBoard logging, plotting and formatting."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleloop.output.metrics import (
    METRIC_COLUMNS,
    ROW_KINDS,
    MetricsLogger,
    format_rate,
    format_seconds,
    format_summary,
    accuracy_limits,
    plot_curves,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _raw_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _log_small_run(run_dir: Path, tensorboard: bool = False) -> Path:
    with MetricsLogger(run_dir, tensorboard=tensorboard) as logger:
        for step in range(1, 7):
            epoch = (step - 1) // 3
            logger.write("step", epoch=epoch, step=step, samples=step * 32, train_loss=2.0 / step, lr=0.1)
            if step % 3 == 0:
                logger.write(
                    "epoch", epoch=epoch, step=step, samples=step * 32, train_loss=1.5 / step,
                    test_loss=1.8 / step, test_acc=0.4 + 0.2 * epoch, samples_per_s=1000.0, wall_s=float(step),
                )
    return run_dir / "metrics.csv"


def test_header_and_rows(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.write("step", epoch=0, step=1, samples=64, train_loss=0.5, lr=0.01)
        logger.write("epoch", epoch=0, step=1, samples=64, test_loss=0.75, test_acc=0.9, wall_s=2.5)
    raw = _raw_rows(tmp_path / "metrics.csv")
    assert tuple(raw[0]) == METRIC_COLUMNS
    assert len(raw) == 3

    step, epoch = read_metrics(tmp_path / "metrics.csv")
    assert step["kind"] == "step"
    assert (step["epoch"], step["step"], step["samples"]) == ("0", "1", "64")
    assert float(step["train_loss"]) == 0.5
    assert float(step["lr"]) == 0.01
    # Values not passed stay as empty cells rather than being dropped or zeroed.
    assert step["test_loss"] == step["test_acc"] == step["wall_s"] == ""

    assert epoch["kind"] == "epoch"
    assert float(epoch["test_loss"]) == 0.75
    assert float(epoch["test_acc"]) == 0.9
    assert float(epoch["wall_s"]) == 2.5
    assert epoch["train_loss"] == "" and epoch["lr"] == ""


def test_a_file_from_before_the_newer_columns_is_read_and_continued(tmp_path: Path) -> None:
    """A run resumed into a metrics.csv written before grad_norm, tokens_per_s and mfu existed: its
    rows keep their values, under the header of today's columns, and the new rows add theirs."""
    older = METRIC_COLUMNS[:METRIC_COLUMNS.index("train_eval_loss")]
    with open(tmp_path / "metrics.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(older)
        writer.writerow(["step", "1", "10", "640", "2.5", "", "", "0.1", "900.0"] + [""] * (len(older) - 9))
        writer.writerow(["step", "1", "20", "1280", "2.25", "", "", "0.1", "950.0"] + [""] * (len(older) - 9))
    assert read_metrics(tmp_path / "metrics.csv")[0]["samples_per_s"] == "900.0"   # as older readers read it
    with MetricsLogger(tmp_path, tensorboard=False, keep_until_step=10) as logger:
        logger.write("step", epoch=1, step=20, samples=1280, train_loss=2.0, samples_per_s=1000.0, grad_norm=0.5,
                     tokens_per_s=64000.0, mfu=None)
    raw = _raw_rows(tmp_path / "metrics.csv")
    assert tuple(raw[0]) == METRIC_COLUMNS
    first, again = read_metrics(tmp_path / "metrics.csv")
    assert (first["step"], first["train_loss"], first["samples_per_s"]) == ("10", "2.5", "900.0")
    assert first["grad_norm"] == first["tokens_per_s"] == first["mfu"] == ""
    assert (again["step"], float(again["tokens_per_s"]), again["mfu"]) == ("20", 64000.0, "")


def test_float_values_round_trip_exactly(tmp_path: Path) -> None:
    value = 1.0 / 3.0
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.write("step", epoch=1, step=7, samples=700, train_loss=value)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert float(row["train_loss"]) == value


def test_file_is_what_csv_writer_writes(tmp_path: Path) -> None:
    """write joins a row's cells itself (nothing in them needs quoting): the bytes are csv.writer's,
    header included, for every kind of number a cell can hold."""
    import io

    import numpy as np

    values = [dict(train_loss=1 / 3, lr=1e-5, samples_per_s=float("inf"), wall_s=-0.0, grad_norm=float("nan")),
              dict(test_loss=np.float32(0.25), test_acc=0.9, slowest_rank=1, skipped_steps=3, mfu=None),
              dict(world_size=2, recovery_s=np.float64(3.25), train_eval_loss=1e22, tokens_per_s=1e-300)]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step, (kind, row) in enumerate(zip(("step", "epoch", "recovery"), values), start=1):
            logger.write(kind, epoch=1, step=step, samples=8 * step, **row)
    expected = io.StringIO(newline="")
    writer = csv.DictWriter(expected, fieldnames=METRIC_COLUMNS, restval="")
    writer.writeheader()
    for step, (kind, row) in enumerate(zip(("step", "epoch", "recovery"), values), start=1):
        writer.writerow({"kind": kind, "epoch": "1", "step": str(step), "samples": str(8 * step),
                         **{k: repr(float(v)) if not isinstance(v, int) else str(v)
                            for k, v in row.items() if v is not None}})
    assert (tmp_path / "metrics.csv").read_bytes() == expected.getvalue().encode("utf-8")


def test_unknown_key_raises_and_writes_nothing(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="bogus"):
            logger.write("step", epoch=0, step=1, samples=8, bogus=1.0)
        with pytest.raises(ValueError, match="unknown row kind 'epochs'; expected one of step, epoch"):
            logger.write("epochs", epoch=0, step=1, samples=8, train_loss=1.0)
    assert read_metrics(tmp_path / "metrics.csv") == []


def test_every_row_kind_is_written_as_its_kind(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step, kind in enumerate(ROW_KINDS, start=1):
            logger.write(kind, epoch=1, step=step, samples=8 * step, train_loss=1.0)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [(r["kind"], r["step"], r["samples"]) for r in rows] == [
        (kind, str(step), str(8 * step)) for step, kind in enumerate(ROW_KINDS, start=1)]


def test_rows_visible_before_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step rows reach the file at flush() (a checkpoint), at an epoch row, or once CSV_EVERY_S
    has passed; not one system call per row."""
    import scaleloop.output.metrics as metrics_module

    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    logger = MetricsLogger(tmp_path, tensorboard=False)
    try:
        logger.write("step", epoch=0, step=1, samples=16, train_loss=1.25)
        assert read_metrics(tmp_path / "metrics.csv") == []                   # buffered
        logger.flush()
        rows = read_metrics(tmp_path / "metrics.csv")
        assert len(rows) == 1 and float(rows[0]["train_loss"]) == 1.25
        logger.write("step", epoch=0, step=2, samples=32, train_loss=1.0)
        clock[0] += metrics_module.CSV_EVERY_S                                  # a second later
        logger.write("step", epoch=0, step=3, samples=48, train_loss=0.75)
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.csv")] == ["1", "2", "3"]
        logger.write("step", epoch=0, step=4, samples=64, train_loss=0.5)
        logger.write("epoch", epoch=0, step=4, samples=64, test_acc=0.5)          # an epoch row flushes
        assert [r["kind"] for r in read_metrics(tmp_path / "metrics.csv")] == ["step"] * 4 + ["epoch"]
    finally:
        logger.close()
    logger.close()  # closing twice must be harmless


def test_log_after_close_raises(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.close()
    with pytest.raises(ValueError):
        logger.write("step", epoch=0, step=1, samples=1, train_loss=1.0)


def test_tensorboard_events_written(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _log_small_run(tmp_path, tensorboard=True)
    tb_dir = tmp_path / "tensorboard"
    events = list(tb_dir.glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file written"
    assert events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "test/loss", "test/acc", "train/lr", "train/samples_per_s"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("test/acc")] == [3, 6]


def test_tensorboard_step_scalars_reach_the_file_at_the_epoch_row(tmp_path: Path) -> None:
    """Step scalars wait (the writer thread would compete with the steps), but an epoch row
    writes and flushes them, before the logger is closed."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def steps_on_disk() -> list[int]:
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [e.step for e in acc.Scalars("train/loss")] if "train/loss" in acc.Tags()["scalars"] else []

    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2):
            logger.write("step", epoch=1, step=step, samples=16 * step, train_loss=1.0 / step)
        assert steps_on_disk() == []
        logger.write("epoch", epoch=1, step=2, samples=32, test_acc=0.5)
        assert steps_on_disk() == [1, 2]


def test_tensorboard_dir_attribute(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path / "on") as logger:
        assert logger.tensorboard_dir == tmp_path / "on" / "tensorboard"
    with MetricsLogger(tmp_path / "off", tensorboard=False) as logger:
        assert logger.tensorboard_dir is None
    assert not (tmp_path / "off" / "tensorboard").exists()
    assert (tmp_path / "off" / "metrics.csv").exists()


def test_plot_curves_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    csv_path = _log_small_run(tmp_path / "run")
    png = tmp_path / "run" / "curves.png"
    assert plot_curves(csv_path, png) == png
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 5000  # a real two-panel figure, not an empty stub


def test_plot_curves_empty_csv_returns_none(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False):
        pass
    png = tmp_path / "curves.png"
    assert plot_curves(tmp_path / "metrics.csv", png) is None
    assert not png.exists()


def test_format_summary_aligns_values() -> None:
    text = format_summary([("device", "cpu"), ("strategy", "single"), ("wall time", "41.2 s")])
    lines = text.splitlines()
    assert lines == [
        "  device     cpu",
        "  strategy   single",
        "  wall time  41.2 s",
    ]
    # All values start in the same column.
    assert len({line.index(v) for line, v in zip(lines, ["cpu", "single", "41.2"])}) == 1
    assert format_summary([]) == ""


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (12345.0, "12.3k samples/s"),
        (850.0, "850 samples/s"),
        (1000.0, "1.0k samples/s"),
        (2_500_000.0, "2.5M samples/s"),
        (3.14159, "3.1 samples/s"),
    ],
)
def test_format_rate(rate: float, expected: str) -> None:
    assert format_rate(rate) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (41.23, "41.2 s"),
        (0.04, "0.0 s"),
        (185, "3 min 05 s"),
        (59.97, "1 min 00 s"),
        (3725, "1 h 02 min"),
    ],
)
def test_format_seconds(seconds: float, expected: str) -> None:
    assert format_seconds(seconds) == expected


def test_import_does_not_load_plotting_or_tensorboard() -> None:
    code = (
        "import sys, scaleloop.output.metrics\n"
        "heavy = [m for m in ('matplotlib', 'tensorboard', 'torch.utils.tensorboard')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == ""


def test_the_accuracy_axis_fits_the_values_within_0_to_100() -> None:
    low, high = accuracy_limits([96.0, 97.5, 98.0])
    assert 94.0 < low < 96.0 and 98.0 < high < 100.0     # not 0-100: 96 % to 98 % must not look flat
    assert accuracy_limits([99.9, 100.0]) == (99.4, 100.0)
    assert accuracy_limits([0.0, 40.0]) == (0.0, 46.0)
