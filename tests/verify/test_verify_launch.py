"""How verify starts its workers, what they are told, and what is shown when they fail."""
from __future__ import annotations

from pathlib import Path

from scaleloop.config import TrainConfig
from scaleloop.verify.dirs import LOG_FILE
from scaleloop.verify.launch import verify_launch, worker_errors
from scaleloop.verify.options import VerifyOptions


def test_workers_are_started_like_train_workers_but_run_the_verify_worker(tmp_path: Path) -> None:
    cmd = verify_launch(TrainConfig(nproc=3, strategy="ddp", max_restarts=4), tmp_path).plain_command()
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=3" in cmd and "--standalone" in cmd
    assert "--max-restarts=0" in cmd  # a restarted worker would record the steps twice
    assert cmd[-3:] == ["-m", "scaleloop.verify.worker", str(tmp_path)]


def test_options_travel_to_the_workers_unchanged(tmp_path: Path) -> None:
    opts = VerifyOptions(steps=4, checks=("equivalence", "sync"), explain_step=2, tolerance=1e-4)
    opts.write(tmp_path / "verify.json")
    assert VerifyOptions.read(tmp_path / "verify.json") == opts


def test_worker_errors_picks_the_exception_out_of_torchrun_noise(tmp_path: Path) -> None:
    assert worker_errors(tmp_path) == []
    (tmp_path / LOG_FILE).write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
        "RuntimeError: Distributed package doesn't have NCCL built in\n"
        "RuntimeError: Distributed package doesn't have NCCL built in\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  rank: 1\n")
    assert worker_errors(tmp_path) == ["RuntimeError: Distributed package doesn't have NCCL built in"]
    (tmp_path / LOG_FILE).write_text("\n".join(f"line {i}" for i in range(40)))
    assert worker_errors(tmp_path, lines=3) == ["line 37", "line 38", "line 39"]
