"""Experiment trackers: where a run's metrics go besides ``metrics.csv`` (``--tracker``).

- ``tensorboard`` (the default): event files in ``<run>/tensorboard/``, when TensorBoard is
  installed (silently none when it is not, as before ``--tracker`` existed).
- ``wandb``: a Weights & Biases run (``pip install 'scaleloop[wandb]'``); W&B's own settings
  apply (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``wandb login``); its files go to ``<run>/wandb/``.
- ``mlflow``: an MLflow run (``pip install 'scaleloop[mlflow]'``) in the store that
  ``MLFLOW_TRACKING_URI`` names, else in a local file store ``<run>/mlruns``.
- ``none``: metrics.csv only.

Only rank 0 opens a tracker (it belongs to :class:`~scaleloop.output.metrics.MetricsLogger`).
Each package is imported inside its class: importing one costs seconds, more than a small
CPU run takes. A package that is missing is a :class:`~scaleloop.errors.UsageError` that names
what to install, raised when the tracker is opened, before a step is trained;
:func:`check_installed` raises the same error earlier still, when the config is validated.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from scaleloop.errors import UsageError
from scaleloop.output.rundir import unwritable

__all__ = ["TRACKERS", "TB_EVERY_S", "Tracker", "TensorBoardTracker", "WandbTracker", "MlflowTracker",
           "check_installed", "open_tracker", "tracker_row"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "none")

# Seconds between hand-overs of step rows to a tracker inside an epoch (see BufferedTracker).
TB_EVERY_S = 30.0

# Tracker name -> (module to import, extra of scaleloop that installs it).
_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}

# metrics.csv column -> the metric's name in a tracker.  Grouping by "train/" and "test/" makes
# TensorBoard and W&B put them in two collapsible sections.
TAGS = {
    "train_loss": "train/loss",
    "test_loss": "test/loss",
    "test_acc": "test/acc",
    "lr": "train/lr",
    "samples_per_s": "train/samples_per_s",
    "wall_s": "train/wall_s",
    "rank_step_s_min": "ranks/step_s_min",
    "rank_step_s_max": "ranks/step_s_max",
    "slowest_rank": "ranks/slowest",
    "skipped_steps": "train/skipped_steps",
    "world_size": "elastic/world_size",
    "recovery_s": "elastic/recovery_s",
    "train_eval_loss": "train/eval_loss",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
}


def tracker_row(kind: str, values: Mapping[str, Optional[float]]) -> dict[str, float]:
    """A metrics.csv row's values under their tracker names (``None`` values left out).

    Per-step train loss is noisy; epoch means keep their own name, ``train/epoch_loss``, so
    that both curves stay readable in one panel.
    """
    row: dict[str, float] = {}
    for key, value in values.items():
        if value is None:
            continue
        tag = "train/epoch_loss" if kind == "epoch" and key == "train_loss" else TAGS[key]
        row[tag] = float(value)
    return row


def _install_hint(name: str) -> str:
    module, extra = _PACKAGES[name]
    return f"--tracker {name} needs the {module} package: pip install 'scaleloop[{extra}]'"


def check_installed(name: str) -> None:
    """UsageError naming what to install when ``--tracker name`` needs a package that is absent.

    Looks the package up without importing it (that would cost seconds), so that the error
    comes before anything is trained or written; opening the tracker imports it for real.
    """
    if name not in _PACKAGES:
        return
    module = _PACKAGES[name][0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(_install_hint(name))


def _import(name: str) -> Any:
    """Import the package of tracker ``name``, or UsageError with what to install."""
    module = _PACKAGES[name][0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == module
        why = "" if missing else f" (importing it failed: {_one_line(exc)})"
        raise UsageError(_install_hint(name) + why) from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class Tracker:
    """One run in an experiment tracker: its config once at the start, metric rows, the end.

    ``log_metrics`` may hold rows back; ``flush`` hands them on (the metrics logger calls it at
    every epoch row); ``close`` flushes and ends the run, as failed when ``error`` is given.
    """

    name = "none"

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's settings (``{name: value}``, possibly nested)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``{metric name: value}`` at optimizer step ``step``."""

    def flush(self) -> None:
        """Hand on every row held back."""

    def close(self, error: Optional[BaseException] = None) -> None:
        """Flush and end the run; ``error``: the exception that ended training, if one did."""


class BufferedTracker(Tracker):
    """Holds step rows back until :meth:`flush` (every epoch row) or ``TB_EVERY_S`` seconds.

    TensorBoard's writer thread checksums every event in pure Python, and writing as the rows
    came competed with the training steps for the interpreter (+9% time on the tutorial
    workload's 0.5 ms steps); the other trackers' clients cost time per call too. metrics.csv
    still gets every row at once.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, dict[str, float], float]] = []
        self._sent = time.monotonic()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._pending.append((int(step), dict(metrics), time.time()))
        if time.monotonic() - self._sent >= TB_EVERY_S:
            self.flush()

    def flush(self) -> None:
        rows, self._pending = self._pending, []
        self._send(rows)
        self._sent = time.monotonic()

    def _send(self, rows: list[tuple[int, dict[str, float], float]]) -> None:
        """Write ``(step, {name: value}, unix time)`` rows to the tracker."""
        raise NotImplementedError


class TensorBoardTracker(BufferedTracker):
    """Scalars in ``log_dir`` (TensorBoard's event files); :meth:`open` is None without TensorBoard."""

    name = "tensorboard"

    def __init__(self, writer: Any, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir
        self._writer = writer

    @classmethod
    def open(cls, log_dir: Path, purge_step: Optional[int] = None) -> Optional["TensorBoardTracker"]:
        try:
            # torch raises ImportError from this module when tensorboard is absent.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        # purge_step hides events a resumed run writes again (steps after its checkpoint).
        # max_queue: an epoch's step scalars arrive in one burst (see BufferedTracker); with
        # the default queue of 10 the training thread would wait for the writer thread every
        # few scalars (~60 us each), with room for 1000 a scalar costs ~6 us.
        _quiet_writer_threads()
        try:
            writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, max_queue=1000, flush_secs=10)
        except OSError as exc:
            raise unwritable(log_dir, exc) from None
        return cls(writer, log_dir)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Nothing: the run directory's config.toml, beside the events, holds the settings."""

    def _send(self, rows: list[tuple[int, dict[str, float], float]]) -> None:
        if self._writer is None:   # closed
            return
        try:
            for step, metrics, _ in rows:
                for tag, value in metrics.items():
                    self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        except OSError as exc:
            # The writer thread's own failure (a full disk), kept by TensorBoard and raised at the
            # next write or flush: one line naming the events file, as for every other file of the run.
            raise unwritable(self._events_file(), exc) from None

    def _events_file(self) -> Path:
        name = getattr(getattr(getattr(self._writer, "file_writer", None), "event_writer", None), "_file_name", None)
        return Path(name) if isinstance(name, str) else self.log_dir

    def close(self, error: Optional[BaseException] = None) -> None:
        if self._writer is None:
            return
        try:
            self.flush()
        finally:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError:
                pass   # its failed write is what flush() said (or what ended the run)


class WandbTracker(BufferedTracker):
    """A Weights & Biases run named after the run directory, its files in ``<run>/wandb/``.

    W&B's own settings decide the rest: ``WANDB_MODE`` (``offline`` writes the run to disk
    only, for ``wandb sync`` later), ``WANDB_PROJECT`` (default here: ``scaleloop``),
    ``WANDB_ENTITY``, the login.
    """

    name = "wandb"

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        wandb = _import("wandb")
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "scaleloop",
                                   dir=str(run_dir), name=Path(run_dir).name)
        except Exception as exc:  # a missing login, a bad setting: one line, before training
            raise UsageError(f"--tracker wandb could not start a run: {_one_line(exc)} "
                             "(WANDB_MODE=offline writes the run to disk only)") from None

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def _send(self, rows: list[tuple[int, dict[str, float], float]]) -> None:
        for step, metrics, _ in rows:
            self._run.log(metrics, step=step)

    def close(self, error: Optional[BaseException] = None) -> None:
        if self._run is not None:
            self.flush()
            self._run.finish(exit_code=0 if error is None else 1)
            self._run = None


class MlflowTracker(BufferedTracker):
    """An MLflow run in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``scaleloop``), named
    after the run directory: the config as params (nested keys joined with "."), metrics per step.

    The store is ``MLFLOW_TRACKING_URI`` when set, else a file store ``<run>/mlruns`` (see it with
    ``mlflow ui --backend-store-uri <run>/mlruns``). Uses an ``MlflowClient``, not the fluent
    ``mlflow.start_run``, so that no global tracking URI or active run is left behind.
    """

    name = "mlflow"
    _BATCH = 1000   # MLflow's limit of metrics per log_batch call (params: 100)

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        _import("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "scaleloop"
        try:
            with _file_store_allowed(uri):
                self._client = MlflowClient(tracking_uri=uri)
                found = self._client.get_experiment_by_name(experiment)
                experiment_id = (found.experiment_id if found is not None
                                 else self._client.create_experiment(experiment))
                self._run_id: Optional[str] = self._client.create_run(
                    experiment_id, run_name=Path(run_dir).name).info.run_id
        except Exception as exc:  # an unreachable server, a store MLflow refuses: one line, before training
            raise UsageError(f"--tracker mlflow could not start a run in {uri}: {_one_line(exc)} "
                             "(set MLFLOW_TRACKING_URI to a store you can write to)") from None
        self.tracking_uri = uri

    @property
    def run_id(self) -> Optional[str]:
        return self._run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):
            self._client.log_batch(self._run_id, params=params[i:i + 100])

    def _send(self, rows: list[tuple[int, dict[str, float], float]]) -> None:
        if not rows:
            return
        from mlflow.entities import Metric

        metrics = [Metric(name, value, int(at * 1000), step) for step, row, at in rows for name, value in row.items()]
        for i in range(0, len(metrics), self._BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + self._BATCH])

    def close(self, error: Optional[BaseException] = None) -> None:
        if self._run_id is not None:
            self.flush()
            status = ("FINISHED" if error is None else
                      "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
            self._client.set_terminated(self._run_id, status=status)
            self._run_id = None


@contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """Let MLflow open the file store that scaleloop chose while the client is being made.

    MLflow 3 keeps its file store in maintenance mode and opens one only with
    ``MLFLOW_ALLOW_FILE_STORE=true``; scaleloop's default store, a folder inside the run
    directory, is one. The variable is set only for a ``file:`` store, only if the user has
    not set it, and removed again (the client keeps the store it opened).
    """
    key = "MLFLOW_ALLOW_FILE_STORE"
    if not uri.startswith("file:") or key in os.environ:
        yield
        return
    os.environ[key] = "true"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _quiet_writer_threads() -> None:
    """Keep the console free of TensorBoard's writer-thread tracebacks.

    The thread that writes the events file keeps the ``OSError`` it hits (a full disk) for the
    next write or flush in the training thread, which the tracker says in one line; it also
    re-raises it, and Python's ``threading.excepthook`` would print the thread's traceback on the
    console first. Installed once; every other thread's exception is printed as before.
    """
    previous = threading.excepthook
    if getattr(previous, "scaleloop_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.scaleloop_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def open_tracker(name: str, run_dir: Path, resume_step: Optional[int] = None) -> Optional[Tracker]:
    """Start tracker ``name`` (one of :data:`TRACKERS`) for the run in ``run_dir``.

    None for ``none``, and for ``tensorboard`` when TensorBoard is not installed. UsageError
    for an unknown name and for a W&B or MLflow package that is missing. ``resume_step``: the
    checkpoint's step when the run continues (TensorBoard hides its own later events).
    """
    if name == "none":
        return None
    run_dir = Path(run_dir)
    if name == "tensorboard":
        purge = resume_step + 1 if resume_step is not None else None
        return TensorBoardTracker.open(run_dir / "tensorboard", purge)
    if name == "wandb":
        return WandbTracker(run_dir)
    if name == "mlflow":
        return MlflowTracker(run_dir)
    raise UsageError(f"--tracker {name!r} is not one of: {', '.join(TRACKERS)}")
