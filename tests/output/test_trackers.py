"""Tests for scaleloop.output.trackers: ``--tracker`` tensorboard | wandb | mlflow | none.

W&B runs in offline mode and MLflow in a local file store, so nothing here touches the
network; the tests that need either package skip when it is not installed.
"""
from __future__ import annotations

import csv
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import pytest

from scaleloop.config import TrainConfig, load_toml
from scaleloop.errors import UsageError
from scaleloop.output.metrics import MetricsLogger
from scaleloop.output.trackers import TRACKERS, Tracker, check_installed, open_tracker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and silent, its folders in tmp; MLflow without a server or the user's settings."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DIR": tmp_path / "wandb-dir", "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                       "WANDB_CACHE_DIR": tmp_path / "wandb-cache", "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(key, str(value))
    for key in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME",
                "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def train_tiny(tmp_path: Path, tracker: str) -> tuple[Path, list[dict[str, str]]]:
    """Two epochs of 4 steps on random data, a metric row every 2 steps; the run dir and its CSV rows."""
    from scaleloop.loop.training import train
    from scaleloop.runtime.dist import DistEnv

    cfg = TrainConfig(data="random", n_samples=128, epochs=2, batch_size=32, out=str(tmp_path / "run"),
                      progress=False, device="cpu", log_every=2, checkpoints=False, tracker=tracker).validate()
    result = train(cfg, DistEnv(), log=lambda _msg: None)
    assert result.run_dir is not None
    with open(result.run_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows if r["kind"] == "step"] == [2, 4, 6, 8]
    return result.run_dir, rows


def column(rows: list[dict[str, str]], kind: str, name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one metrics.csv column over the rows of one kind."""
    return [(int(r["step"]), float(r[name])) for r in rows if r["kind"] == kind and r[name]]


# --- MLflow -----------------------------------------------------------------------------------------


def test_mlflow_records_config_and_every_metric_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="--tracker mlflow needs: pip install 'scaleloop[mlflow]'")
    from mlflow.tracking import MlflowClient

    run_dir, rows = train_tiny(tmp_path, "mlflow")
    # scaleloop let MLflow open its file store for the run, and left the environment as it was.
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 opens a file store only with it
    client = MlflowClient((run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("scaleloop")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    params = run.data.params
    assert (params["tracker"], params["lr"], params["batch_size"], params["model"]) == ("mlflow", "0.01", "32",
                                                                                          "simplenet")

    def history(name: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))

    assert history("train/loss") == column(rows, "step", "train_loss")
    assert history("train/epoch_loss") == column(rows, "epoch", "train_loss")
    assert history("test/acc") == column(rows, "epoch", "test_acc")
    assert [s for s, _ in history("train/lr")] == [2, 4, 4, 6, 8, 8]   # step rows and epoch rows


def test_mlflow_uses_the_tracking_uri_and_experiment_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="--tracker mlflow needs: pip install 'scaleloop[mlflow]'")
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "shared-store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # the user's own file store: the user's opt-in
    with MetricsLogger(tmp_path / "run", tracker="mlflow", config={"lr": 0.5, "nested": {"a": 1}}) as logger:
        logger.write("step", epoch=1, step=3, samples=96, train_loss=0.25)
        run_id = logger.tracker.run_id
    assert not (tmp_path / "run" / "mlruns").exists()
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "mine"
    assert run.data.params == {"lr": "0.5", "nested.a": "1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(3, 0.25)]


def test_mlflow_run_of_a_failed_training_is_marked_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="--tracker mlflow needs: pip install 'scaleloop[mlflow]'")
    from mlflow.tracking import MlflowClient

    logger = MetricsLogger(tmp_path, tracker="mlflow")
    run_id = logger.tracker.run_id
    with pytest.raises(RuntimeError):
        try:
            logger.write("step", epoch=1, step=1, samples=8, train_loss=1.0)
            raise RuntimeError("out of memory")
        finally:
            logger.close()   # as training.py does: in a finally, while the error propagates
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = MlflowClient((tmp_path / "mlruns").as_uri()).get_run(run_id)
    assert run.info.status == "FAILED"
    assert "train/loss" in run.data.metrics   # the rows before the failure were sent


# --- Weights & Biases -------------------------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's ``.wandb`` file (a LevelDB-style log of protobuf ``Record``s
    after a 7-byte ``:W&B`` header), as ``wandb sync`` reads them."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="this wandb has no wandb.proto")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:                  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:                                # zero padding up to the next block
            pos += block - pos % block
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                           # FULL, or the LAST piece of a record
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def read_wandb_run(run_dir: Path) -> tuple[Any, dict[str, Any], list[dict[str, Any]], Optional[int]]:
    """(the run record, its config, its history rows, the exit code) of the offline run in ``run_dir``."""
    import json

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run, config, history, exit_code = None, {}, [], None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return run, config, history, exit_code


def test_wandb_offline_records_config_and_every_metric_row(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb", reason="--tracker wandb needs: pip install 'scaleloop[wandb]'")
    try:
        run_dir, rows = train_tiny(tmp_path, "wandb")
    finally:
        # W&B keeps a service process (wandb-core) for the life of the Python process that used it;
        # the suite checks that no test leaves a process behind.
        wandb.teardown()
    run, config, history, exit_code = read_wandb_run(run_dir)
    assert run.display_name == run_dir.name and run.project == "scaleloop"
    assert (config["tracker"], config["lr"], config["batch_size"], config["model"]) == ("wandb", 0.01, 32, "simplenet")
    assert config["out"] == str(run_dir)

    def logged(name: str) -> list[tuple[int, float]]:
        return [(row["_step"], row[name]) for row in history if name in row]

    assert logged("train/loss") == column(rows, "step", "train_loss")
    assert logged("train/epoch_loss") == column(rows, "epoch", "train_loss")
    assert logged("test/acc") == column(rows, "epoch", "test_acc")
    assert exit_code == 0
    assert not (tmp_path / "wandb-dir").exists()   # the run's files are in the run directory


# --- a missing package ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_one_line_saying_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)   # as if it were not installed
    expected = f"--tracker {name} needs the {name} package: pip install 'scaleloop[{name}]'"
    # When the config is checked: before a run directory exists ...
    with pytest.raises(UsageError) as caught:
        TrainConfig(tracker=name).validate()
    assert str(caught.value) == expected
    # ... and when the tracker is opened: before metrics.csv is written.
    with pytest.raises(UsageError) as caught:
        MetricsLogger(tmp_path / "run", tracker=name)
    assert str(caught.value) == expected
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_a_broken_package_says_why_it_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import scaleloop.output.trackers as trackers

    def broken(name: str) -> None:
        raise ImportError("cannot import name 'builder' from 'google.protobuf.internal'\nmore")

    monkeypatch.setattr(trackers.importlib, "import_module", broken)
    with pytest.raises(UsageError) as caught:
        open_tracker("wandb", tmp_path)
    assert str(caught.value) == ("--tracker wandb needs the wandb package: pip install 'scaleloop[wandb]' "
                                 "(importing it failed: cannot import name 'builder' from 'google.protobuf.internal')")


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_cli_missing_package_exits_2_with_one_line(tmp_path: Path, name: str) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    # Imported at start-up by site: the package looks uninstalled to this interpreter.
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{name!r}] = None\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(hide), str(ROOT / "src")])
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "scaleloop", "train", "--tracker", name, "--data", "random",
                          "--epochs", "1", "--device", "cpu", "--no-progress", "--out", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [f"scaleloop: error: --tracker {name} needs the {name} package: "
                                       f"pip install 'scaleloop[{name}]'"]
    assert "Traceback" not in res.stdout + res.stderr
    assert not out.exists()   # nothing trained, nothing written


def test_checking_the_config_imports_neither_package() -> None:
    """Importing wandb or mlflow takes seconds: validate() only looks them up."""
    code = ("import sys\nfrom scaleloop.config import TrainConfig\nimport scaleloop.output.metrics\n"
            "for name in ('wandb', 'mlflow'):\n"
            "    try:\n        TrainConfig(tracker=name).validate()\n    except Exception:\n        pass\n"
            "print(','.join(m for m in ('wandb', 'mlflow', 'torch') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert res.stdout.strip() == ""


# --- the setting, and what MetricsLogger hands a tracker ---------------------------------------------


def test_tracker_setting_choices_and_the_older_tensorboard_setting(tmp_path: Path) -> None:
    assert TrainConfig().tracker == "tensorboard" and TRACKERS == ("tensorboard", "wandb", "mlflow", "none")
    with pytest.raises(UsageError, match=r"--tracker 'neptune' is not one of: tensorboard, wandb, mlflow, none"):
        TrainConfig(tracker="neptune").validate()
    check_installed("none")
    check_installed("tensorboard")   # optional as before: no events when TensorBoard is absent, no error
    # A config file from before --tracker still loads; tensorboard = false still means no events.
    old = tmp_path / "old.toml"
    old.write_text("tensorboard = false\n")
    assert load_toml(old) == {"tensorboard": False}
    with MetricsLogger(tmp_path / "off", tensorboard=False, tracker="tensorboard") as logger:
        assert logger.tracker is None and logger.tensorboard_dir is None
    with MetricsLogger(tmp_path / "none", tracker="none") as logger:
        assert logger.tracker is None
    assert not (tmp_path / "off" / "tensorboard").exists() and not (tmp_path / "none" / "tensorboard").exists()


def test_cli_flag_parses() -> None:
    from scaleloop.cli import build_parser
    from scaleloop.commands.cmdline import flag_values

    args = build_parser().parse_args(["train", "--tracker", "none", "--no-tensorboard"])
    assert flag_values(args) == {"tracker": "none", "tensorboard": False}
    with pytest.raises(UsageError, match="invalid choice"):
        build_parser().parse_args(["train", "--tracker", "neptune"])


class Recording(Tracker):
    def __init__(self) -> None:
        self.config: Optional[Mapping[str, Any]] = None
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.flushes = 0
        self.closed_with: Any = "open"

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.config = config

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        self.flushes += 1

    def close(self, error: Optional[BaseException] = None) -> None:
        self.closed_with = error


def test_metrics_logger_hands_the_tracker_config_rows_and_the_end(tmp_path: Path) -> None:
    tracker = Recording()
    with MetricsLogger(tmp_path, tracker=tracker, config=TrainConfig(lr=0.5)) as logger:
        assert tracker.config is not None and tracker.config["lr"] == 0.5 and tracker.config["tracker"] == "tensorboard"
        logger.write("step", epoch=1, step=2, samples=64, train_loss=0.75, lr=0.5)
        assert tracker.flushes == 0
        logger.write("epoch", epoch=1, step=2, samples=64, train_loss=0.5, test_acc=0.9, test_loss=None)
        assert tracker.flushes == 1   # an epoch row sends what waits
    assert tracker.rows == [(2, {"train/loss": 0.75, "train/lr": 0.5}),
                            (2, {"train/epoch_loss": 0.5, "test/acc": 0.9})]
    assert tracker.closed_with is None

    failed = Recording()
    with pytest.raises(KeyboardInterrupt):
        with MetricsLogger(tmp_path / "b", tracker=failed):
            raise KeyboardInterrupt
    assert isinstance(failed.closed_with, KeyboardInterrupt)


def test_close_in_a_finally_tells_the_tracker_whether_training_failed(tmp_path: Path) -> None:
    def training(tracker: Recording, fail: bool) -> None:   # the shape of loop.training.train
        logger = MetricsLogger(tmp_path / str(fail), tracker=tracker)
        try:
            if fail:
                raise ValueError("diverged")
        finally:
            logger.close()

    failed, finished = Recording(), Recording()
    with pytest.raises(ValueError):
        training(failed, fail=True)
    assert isinstance(failed.closed_with, ValueError)
    try:
        raise KeyError("an error the caller handles, e.g. by training again with a smaller batch")
    except KeyError:
        training(finished, fail=False)
    assert finished.closed_with is None
