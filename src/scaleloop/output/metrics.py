"""Rank-0 writers for a run directory: a metrics CSV, a tracker (TensorBoard, W&B, MLflow) and a PNG.

Only the process with rank 0 should create a :class:`MetricsLogger`; the other
ranks have nothing to write.  matplotlib and the trackers' packages are imported lazily
inside the functions that need them, because importing any of them costs far more
start-up time than the training script itself on a small CPU run.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Mapping, Optional, Sequence, Union

from scaleloop.output.rundir import RunDirWriteError, unwritable
from scaleloop.output.trackers import TensorBoardTracker, Tracker, open_tracker, tracker_row

# Seconds between flushes of metrics.csv inside an epoch: a killed run loses at most this much.
CSV_EVERY_S = 1.0

__all__ = [
    "METRIC_COLUMNS",
    "ROW_KINDS",
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
    "rank_step_s_min",
    "rank_step_s_max",
    "slowest_rank",
    "skipped_steps",
    "world_size",
    "recovery_s",
    # Added after the others (older readers of the file find their columns where they were).
    "train_eval_loss",
    "grad_norm",   # the log row's step: the whole gradient's norm before clipping
    "tokens_per_s",   # step rows of token data: tokens trained on per second, all ranks (loop.rows)
    "mfu",            # ... and the model FLOPs utilisation, a fraction, where the device's peak is known
)

#: The kinds of row (the ``kind`` column), each what :meth:`MetricsLogger.write` records:
#:
#: - ``step``: a log row, every ``--log-every`` optimizer steps: the training loss of the steps
#:   since the last one, the learning rate, the speed;
#: - ``epoch``: the end of an epoch, with its training loss and the test set's loss and accuracy;
#: - ``stop``: where a run stopped inside an epoch (``--max-steps``), with the loss of the epoch
#:   so far. Not an ``epoch`` row: the run that resumes it writes that one;
#: - ``eval``: an evaluation inside the run (``--eval-every``), with ``test_loss``, ``test_acc``
#:   and, with ``--eval-train``, ``train_eval_loss``;
#: - ``recovery``: a recovery from a fault (``runtime.recovery``), at the first step after it,
#:   with the new ``world_size`` and ``recovery_s``, the seconds it took.
ROW_KINDS: tuple[str, ...] = ("step", "epoch", "stop", "eval", "recovery")

# The columns a caller may pass as keyword values, each with its place in a row (the first four
# are write's own arguments).
_VALUE_PLACES: dict[str, int] = {name: place for place, name in enumerate(METRIC_COLUMNS[4:], start=4)}


def _csv_line(cells: Sequence[str]) -> str:
    """A line of metrics.csv, as csv.writer's default (excel) dialect writes it. Every cell is a
    column name, a row kind or a number (:func:`_format_cell`), none of which CSV quotes, so the
    line is joined directly: csv.writer looks at every character of every cell for one to quote,
    and a log row comes every few milliseconds on a small model."""
    return ",".join(cells) + "\r\n"


def _format_cell(value: float) -> str:
    # repr() of a float round-trips exactly, so reading the CSV back loses nothing.
    if type(value) is float:   # most cells: checked first (a bool is not a float)
        return repr(value)
    if isinstance(value, bool):
        raise TypeError("metric values must be numbers, not bool")
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class MetricsLogger:
    """Append step and epoch metrics to ``run_dir/metrics.csv`` and to a tracker.

    Rows are flushed to disk at every epoch row, at every checkpoint (:meth:`flush`) and
    otherwise at most every ``CSV_EVERY_S``, so an interrupted run keeps everything up to
    its last checkpoint and loses at most the last second of step rows.

    ``tracker``: a name of :data:`~scaleloop.output.trackers.TRACKERS` or a
    :class:`~scaleloop.output.trackers.Tracker`; by default TensorBoard, which
    ``tensorboard=False`` (the setting older configs hold) turns off. The tracker starts
    first, so that a missing package is an error before anything is written; ``config`` (a
    mapping, or a dataclass such as ``TrainConfig``) is logged to it once. TensorBoard events
    go to ``run_dir/tensorboard/`` when the TensorBoard package is installed;
    :attr:`tensorboard_dir` is ``None`` otherwise.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, keep_until_step: int | None = None,
                 tracker: Union[str, Tracker, None] = None, config: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tracker is None or tracker == "tensorboard":
            tracker = "tensorboard" if tensorboard else "none"
        self.tracker: Optional[Tracker] = (open_tracker(tracker, self.run_dir, resume_step=keep_until_step)
                                           if isinstance(tracker, str) else tracker)
        self.tensorboard_dir: Path | None = (self.tracker.log_dir if isinstance(self.tracker, TensorBoardTracker)
                                             else None)
        self.csv_path = self.run_dir / "metrics.csv"
        try:
            if self.tracker is not None and config is not None:
                self.tracker.log_config(_as_mapping(config))
            self._open_csv(keep_until_step)
        except BaseException as exc:
            if self.tracker is not None:
                try:
                    self.tracker.close(exc)
                except (OSError, RunDirWriteError):
                    pass   # the same disk: the error on its way says it
            raise

    def _open_csv(self, keep_until_step: int | None) -> None:
        try:
            self._open_csv_file(keep_until_step)
        except OSError as exc:   # a full or read-only disk at the start: one line naming the file
            file, self._file = getattr(self, "_file", None), None
            if file is not None:
                try:
                    file.close()   # now: closed later, its unwritten rows would be reported again
                except OSError:
                    pass
            raise unwritable(self.csv_path, exc) from None

    def _open_csv_file(self, keep_until_step: int | None) -> None:
        if keep_until_step is not None and self.csv_path.exists():
            # A resumed run: keep what was logged up to its checkpoint and append after it;
            # rows of steps that the resumed run takes again are dropped, not duplicated.
            self._truncate(keep_until_step)
            self._file: IO[str] | None = open(self.csv_path, "a", newline="", encoding="utf-8")
        else:
            self._file = open(self.csv_path, "w", newline="", encoding="utf-8")
            self._file.write(_csv_line(METRIC_COLUMNS))
        self._file.flush()
        self._csv_flushed = time.monotonic()

    def _truncate(self, keep_until_step: int) -> None:
        rows = [r for r in read_metrics(self.csv_path)
                if r.get("step", "").isdigit() and int(r["step"]) <= keep_until_step]
        tmp = self.csv_path.with_name(f".{self.csv_path.name}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.csv_path)

    def write(self, kind: str, *, epoch: int, step: int, samples: int, **values: Any) -> None:
        """Record a row of ``kind`` (one of :data:`ROW_KINDS`) at ``epoch``, global ``step`` and
        ``samples`` trained so far; ``values`` are keys of :data:`METRIC_COLUMNS` (None: an empty cell)."""
        if kind not in ROW_KINDS:
            raise ValueError(f"unknown row kind {kind!r}; expected one of {', '.join(ROW_KINDS)}")
        # The row's cells in METRIC_COLUMNS order, empty where no value is given.
        cells = [kind, str(int(epoch)), str(int(step)), str(int(samples))] + [""] * len(_VALUE_PLACES)
        for key, value in values.items():
            place = _VALUE_PLACES.get(key)
            if place is None:
                raise ValueError(f"unknown metric(s) {sorted(set(values) - _VALUE_PLACES.keys())}; "
                                 f"expected some of {sorted(_VALUE_PLACES)}")
            if value is not None:
                cells[place] = _format_cell(value)
        if self._file is None:
            raise ValueError("MetricsLogger is closed")
        self._file.write(_csv_line(cells))
        # Flushed at most every CSV_EVERY_S (and at every epoch row, checkpoint and close): a
        # flush per row was a system call every few milliseconds on small, fast steps.
        if kind != "step" or time.monotonic() - self._csv_flushed >= CSV_EVERY_S:
            self.flush()

        if self.tracker is not None:
            # Step rows wait in the tracker (at most TB_EVERY_S, see BufferedTracker); an epoch
            # row sends them all.
            self.tracker.log_metrics(int(step), tracker_row("epoch" if kind == "stop" else kind, values))
            if kind != "step":
                self.tracker.flush()

    def flush(self) -> None:
        """Write what is buffered to metrics.csv now (a checkpoint calls this first, so that
        the rows up to it are on disk when the run resumes from it)."""
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:   # disk full or read-only: one line naming the file
                raise unwritable(self.csv_path, exc) from None
        self._csv_flushed = time.monotonic()

    def close(self, error: Optional[BaseException] = None) -> None:
        """Flush and close the CSV file and end the tracker's run; safe to call twice.

        The tracker's run ends as failed when ``error`` is given, or when ``close`` runs in a
        ``finally`` that an exception passes through (as around the training loop).
        """
        passing = error if error is not None else _passing_through(sys._getframe(1))
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                if passing is None:   # else the error on its way already says what went wrong
                    raise unwritable(self.csv_path, exc) from None
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            try:
                tracker.close(passing)
            except (OSError, RunDirWriteError):
                if passing is None:
                    raise
                # The tracker's files are on the disk that failed: its own error on the way out
                # (TensorBoard raises a failed write again at close) must not hide the one passing.

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exc)


def _passing_through(frame: Any) -> Optional[BaseException]:
    """The exception propagating through ``frame`` (its traceback holds the frame), if any; not
    one that a caller further up is handling (training started from an ``except`` block)."""
    exc = sys.exc_info()[1]
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame is frame:
            return exc
        tb = tb.tb_next
    return None


def _as_mapping(config: Any) -> Mapping[str, Any]:
    """A mapping as it is; a dataclass by its fields, the fields of a section (a dataclass field of
    ``TrainConfig``) by their own names: the settings as their flags name them (``lr``, not ``optim.lr``)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return dict(config)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(dataclasses.asdict(value))
        else:
            out[f.name] = value
    return out


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


def accuracy_limits(percents: Sequence[float]) -> tuple[float, float]:
    """The accuracy axis's range: the values with a margin, within 0-100 %. (A fixed 0-100 axis
    draws 96 % to 98 % as a flat line.)"""
    low, high = min(percents), max(percents)
    pad = max((high - low) * 0.15, 0.5)
    return max(0.0, low - pad), min(100.0, high + pad)


def plot_curves(csv_path: Path, png_path: Path) -> Path | None:
    """Plot loss and accuracy curves from ``csv_path`` into ``png_path``.

    Left panel: train loss per step (thin line) plus per-epoch train and test
    loss (markers), and the test and evaluation-mode train loss of the ``eval``
    rows (``--eval-every``), all against the global step.  Right panel: test
    accuracy in percent per epoch.  Returns ``png_path``, or ``None`` when matplotlib is not
    installed or the CSV holds nothing to plot.
    """
    rows = read_metrics(Path(csv_path))
    steps = [r for r in rows if r.get("kind") == "step"]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    step_loss = _floats(steps, "step", "train_loss")
    epoch_train = _floats(epochs, "step", "train_loss")
    epoch_test = _floats(epochs, "step", "test_loss")
    acc_epoch, acc = _floats(epochs, "epoch", "test_acc")
    evals = [r for r in rows if r.get("kind") == "eval"]
    eval_test = _floats(evals, "step", "test_loss")
    eval_train = _floats(evals, "step", "train_eval_loss")
    if not (step_loss[0] or epoch_train[0] or epoch_test[0] or acc or eval_test[0] or eval_train[0]):
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
    if eval_test[0]:
        ax_loss.plot(*eval_test, marker=".", label="test loss (eval)")
    if eval_train[0]:
        ax_loss.plot(*eval_train, marker=".", label="train loss (eval)")
    ax_loss.set_title("Loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, alpha=0.3)
    if ax_loss.has_data():
        ax_loss.legend()

    # Accept accuracy stored either as a fraction or already as a percentage.
    scale = 100.0 if acc and max(acc) <= 1.0 else 1.0
    if acc:
        shown = [a * scale for a in acc]
        ax_acc.plot(acc_epoch, shown, marker="o", color="tab:green")
        ax_acc.set_ylim(*accuracy_limits(shown))
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
