"""Rank-0 writers for a run directory: a metrics CSV, TensorBoard events and a PNG.

Only the process with rank 0 should create a :class:`MetricsLogger`; the other
ranks have nothing to write.  matplotlib and TensorBoard are imported lazily
inside the functions that need them, because importing either costs far more
start-up time than the training script itself on a small CPU run.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

# Seconds between TensorBoard writes of step rows inside an epoch (see _write_tensorboard).
TB_EVERY_S = 30.0
# Seconds between flushes of metrics.csv inside an epoch: a killed run loses at most this much.
CSV_EVERY_S = 1.0

__all__ = [
    "METRIC_COLUMNS",
    "MetricsLogger",
    "read_metrics",
    "plot_curves",
    "format_summary",
    "format_rate",
    "format_seconds",
]

METRIC_COLUMNS: tuple[str, ...] = (
    "kind",
    "epoch",
    "step",
    "samples",
    "train_loss",
    "test_loss",
    "test_acc",
    "lr",
    "samples_per_s",
    "wall_s",
)

# Columns a caller may pass as keyword values; the others are positional.
_VALUE_COLUMNS = frozenset(METRIC_COLUMNS) - {"kind", "epoch", "step", "samples"}

# CSV column -> TensorBoard tag.  Grouping by "train/" and "test/" makes
# TensorBoard put them in two collapsible sections.
_TB_TAGS = {
    "train_loss": "train/loss",
    "test_loss": "test/loss",
    "test_acc": "test/acc",
    "lr": "train/lr",
    "samples_per_s": "train/samples_per_s",
    "wall_s": "train/wall_s",
}


def _format_cell(value: float) -> str:
    # repr() of a float round-trips exactly, so reading the CSV back loses nothing.
    if isinstance(value, bool):
        raise TypeError("metric values must be numbers, not bool")
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class MetricsLogger:
    """Append step and epoch metrics to ``run_dir/metrics.csv`` and TensorBoard.

    Rows are flushed to disk at every epoch row, at every checkpoint (:meth:`flush`) and
    otherwise at most every ``CSV_EVERY_S``, so an interrupted run keeps everything up to
    its last checkpoint and loses at most the last second of step rows.  TensorBoard events
    go to ``run_dir/tensorboard/`` when ``tensorboard`` is true and the TensorBoard package is installed;
    :attr:`tensorboard_dir` is ``None`` otherwise.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, keep_until_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.run_dir / "metrics.csv"
        if keep_until_step is not None and self.csv_path.exists():
            # A resumed run: keep what was logged up to its checkpoint and append after it;
            # rows of steps that the resumed run takes again are dropped, not duplicated.
            self._truncate(keep_until_step)
            self._file: IO[str] | None = open(self.csv_path, "a", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._file, fieldnames=METRIC_COLUMNS, restval="")
        else:
            self._file = open(self.csv_path, "w", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._file, fieldnames=METRIC_COLUMNS, restval="")
            self._writer.writeheader()
        self._file.flush()

        self.tensorboard_dir: Path | None = None
        self._tb: Any = None
        self._tb_pending: list[tuple[str, float, int]] = []
        self._tb_written = self._csv_flushed = time.monotonic()
        if tensorboard:
            purge = keep_until_step + 1 if keep_until_step is not None else None
            self._tb = self._open_tensorboard(self.run_dir / "tensorboard", purge)
            if self._tb is not None:
                self.tensorboard_dir = self.run_dir / "tensorboard"

    def _truncate(self, keep_until_step: int) -> None:
        rows = [r for r in read_metrics(self.csv_path)
                if r.get("step", "").isdigit() and int(r["step"]) <= keep_until_step]
        tmp = self.csv_path.with_name(f".{self.csv_path.name}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.csv_path)

    @staticmethod
    def _open_tensorboard(log_dir: Path, purge_step: int | None = None) -> Any:
        try:
            # torch raises ImportError from this module when tensorboard is absent.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        # purge_step hides events a resumed run writes again (steps after its checkpoint).
        # max_queue: an epoch's step scalars arrive in one burst (see _write_tensorboard); with
        # the default queue of 10 the training thread would wait for the writer thread every
        # few scalars (~60 us each), with room for 1000 a scalar costs ~6 us.
        return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, max_queue=1000, flush_secs=10)

    def log_step(self, step: int, epoch: int, samples: int, **values: float) -> None:
        """Record one optimizer step; ``values`` are keys of :data:`METRIC_COLUMNS`."""
        self._write("step", epoch=epoch, step=step, samples=samples, values=values)

    def log_epoch(self, epoch: int, step: int, samples: int, **values: float) -> None:
        """Record the end of an epoch; ``values`` are keys of :data:`METRIC_COLUMNS`."""
        self._write("epoch", epoch=epoch, step=step, samples=samples, values=values)

    def _write(
        self, kind: str, *, epoch: int, step: int, samples: int, values: dict[str, float]
    ) -> None:
        unknown = sorted(set(values) - _VALUE_COLUMNS)
        if unknown:
            raise ValueError(
                f"unknown metric(s) {unknown}; expected some of {sorted(_VALUE_COLUMNS)}"
            )
        if self._file is None:
            raise ValueError("MetricsLogger is closed")
        row: dict[str, str] = {
            "kind": kind,
            "epoch": str(int(epoch)),
            "step": str(int(step)),
            "samples": str(int(samples)),
        }
        for key, value in values.items():
            if value is not None:
                row[key] = _format_cell(value)
        self._writer.writerow(row)
        # Flushed at most every CSV_EVERY_S (and at every epoch row, checkpoint and close): a
        # flush per row was a system call every few milliseconds on small, fast steps.
        if kind == "epoch" or time.monotonic() - self._csv_flushed >= CSV_EVERY_S:
            self.flush()

        if self._tb is not None:
            for key, value in values.items():
                if value is None:
                    continue
                # Per-step train loss is noisy; keep epoch means under their own tag
                # so both curves stay readable in one TensorBoard panel.
                tag = _TB_TAGS[key]
                if kind == "epoch" and key == "train_loss":
                    tag = "train/epoch_loss"
                self._tb_pending.append((tag, float(value), int(step)))
            if kind == "epoch" or time.monotonic() - self._tb_written >= TB_EVERY_S:
                self._write_tensorboard()

    def _write_tensorboard(self) -> None:
        """Hand the pending scalars to TensorBoard's writer, and flush it.

        Step rows wait for the end of the epoch (or TB_EVERY_S): TensorBoard's writer thread
        checksums every event in pure Python, and writing as the rows come competed with the
        training steps for the interpreter (+9% time on the tutorial workload's 0.5 ms steps).
        metrics.csv still gets every row at once.
        """
        for tag, value, step in self._tb_pending:
            self._tb.add_scalar(tag, value, global_step=step)
        self._tb_pending.clear()
        self._tb.flush()
        self._tb_written = time.monotonic()

    def flush(self) -> None:
        """Write what is buffered to metrics.csv now (a checkpoint calls this first, so that
        the rows up to it are on disk when the run resumes from it)."""
        if self._file is not None:
            self._file.flush()
        self._csv_flushed = time.monotonic()

    def close(self) -> None:
        """Flush and close the CSV file and the TensorBoard writer; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._write_tensorboard()
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(csv_path: Path) -> list[dict[str, str]]:
    """Return the rows of a metrics CSV as dicts of strings (empty cells are "")."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _floats(rows: list[dict[str, str]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        x, y = row.get(x_key, ""), row.get(y_key, "")
        if x and y:
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def plot_curves(csv_path: Path, png_path: Path) -> Path | None:
    """Plot loss and accuracy curves from ``csv_path`` into ``png_path``.

    Left panel: train loss per step (thin line) plus per-epoch train and test
    loss (markers), all against the global step.  Right panel: test accuracy in
    percent per epoch.  Returns ``png_path``, or ``None`` when matplotlib is not
    installed or the CSV holds nothing to plot.
    """
    rows = read_metrics(Path(csv_path))
    steps = [r for r in rows if r.get("kind") == "step"]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    step_loss = _floats(steps, "step", "train_loss")
    epoch_train = _floats(epochs, "step", "train_loss")
    epoch_test = _floats(epochs, "step", "test_loss")
    acc_epoch, acc = _floats(epochs, "epoch", "test_acc")
    if not (step_loss[0] or epoch_train[0] or epoch_test[0] or acc):
        return None

    try:
        # Figure + the Agg canvas avoids pyplot's global state and any GUI backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)

    if step_loss[0]:
        ax_loss.plot(*step_loss, linewidth=0.8, alpha=0.6, label="train loss (step)")
    if epoch_train[0]:
        ax_loss.plot(*epoch_train, marker="o", label="train loss (epoch)")
    if epoch_test[0]:
        ax_loss.plot(*epoch_test, marker="s", label="test loss (epoch)")
    ax_loss.set_title("Loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, alpha=0.3)
    if ax_loss.has_data():
        ax_loss.legend()

    # Accept accuracy stored either as a fraction or already as a percentage.
    scale = 100.0 if acc and max(acc) <= 1.0 else 1.0
    if acc:
        ax_acc.plot(acc_epoch, [a * scale for a in acc], marker="o", color="tab:green")
        ax_acc.set_ylim(0, 100)
    # Epochs are whole numbers; without this a 2-epoch run gets ticks at 0.2, 0.4, ...
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set_title("Test accuracy")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.grid(True, alpha=0.3)

    fig.suptitle(f"Training curves - {Path(csv_path).parent.name}")
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path


def format_summary(rows: list[tuple[str, str]]) -> str:
    """Align ``(key, value)`` pairs into a two-column block, indented two spaces."""
    if not rows:
        return ""
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key:<{width}}  {value}".rstrip() for key, value in rows)


def format_rate(samples_per_s: float) -> str:
    """Human-readable throughput, e.g. ``"850 samples/s"`` or ``"12.3k samples/s"``."""
    rate = float(samples_per_s)
    if not math.isfinite(rate):
        return f"{rate} samples/s"
    if abs(rate) >= 999_950:
        return f"{rate / 1e6:.1f}M samples/s"
    if abs(rate) >= 999.5:
        return f"{rate / 1e3:.1f}k samples/s"
    if abs(rate) >= 10:
        return f"{rate:.0f} samples/s"
    return f"{rate:.1f} samples/s"


def format_seconds(s: float) -> str:
    """Human-readable duration, e.g. ``"41.2 s"``, ``"3 min 05 s"``, ``"1 h 02 min"``."""
    s = float(s)
    if not math.isfinite(s) or s < 59.95:
        return f"{s:.1f} s"
    total = int(round(s))
    if total < 3600:
        minutes, secs = divmod(total, 60)
        return f"{minutes} min {secs:02d} s"
    hours, rest = divmod(total, 3600)
    return f"{hours} h {rest // 60:02d} min"
