"""A checkpoint that cannot be written (disk full, read-only run directory) ends the run with one
line naming the checkpoint's directory, the space needed and free, the newest valid checkpoint and
how to continue; nothing of the failed checkpoint is left, and ``latest`` still names the last
good one. A full disk is found before the checkpoint is written where its size is known, and
part-way through otherwise (every writer: whole ``state.pt`` or sharded DCP files)."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from scaleloop.checkpoint import store
from scaleloop.cli import main
from scaleloop.commands.doctor import diagnose
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.dist import DistEnv


def config(tmp_path: Path) -> TrainConfig:
    return TrainConfig(data="random", n_samples=512, epochs=1, batch_size=64, out=str(tmp_path / "run"),
                       progress=False, tensorboard=False, device="cpu", checkpoint_every=2).validate()


def fail_at_step(monkeypatch: pytest.MonkeyPatch, step: int, err: int) -> None:
    """Writes of the checkpoint of ``step`` fail with ``err`` (after a part of its state.pt is written)."""
    real = store._write_file

    def write(path: Path, data: bytes) -> None:
        if f"step-{step:08d}" in str(path.parent) and path.name == store.STATE_FILE:
            path.write_bytes(data[: len(data) // 2])
            raise OSError(err, os.strerror(err))
        real(path, data)

    monkeypatch.setattr(store, "_write_file", write)


def test_a_full_disk_ends_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fail_at_step(monkeypatch, 4, errno.ENOSPC)   # part-way: the space check before it passed
    cfg = config(tmp_path)
    with pytest.raises(RunDirWriteError) as caught:
        train(cfg, DistEnv(), log=lambda _msg: None)
    root = Path(cfg.checkpointing.out) / "checkpoints"
    assert re.fullmatch(
        rf"cannot write '{root}/step-00000004': disk full \(it needs [\d.]+ KB, [\d.]+ [KMGT]?B "
        rf"free\); the newest valid checkpoint is '{root}/step-00000002' \(step 2\); once space is freed, continue "
        rf"with: scaleloop train --out {cfg.checkpointing.out}", str(caught.value)), str(caught.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]   # no .tmp-step-... left
    assert (root / "latest").read_text().strip() == "step-00000002"
    told = diagnose(Path(cfg.checkpointing.out))   # the loop's record of the ending, read from the directory alone
    assert told.state == "unwritable"
    assert told.what == f"stopped while writing the checkpoint of step 4: {caught.value}"
    assert told.checkpoint is not None and told.checkpoint.step == 2


def test_a_read_only_run_directory_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = store.begin_checkpoint

    def begin(root: Path, step: int) -> Path:
        if step == 4:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(root / f".tmp-step-{step:08d}"))
        return real(root, step)

    monkeypatch.setattr("scaleloop.checkpoint.manager.begin_checkpoint", begin)
    cfg = config(tmp_path)
    with pytest.raises(RunDirWriteError, match=r"read-only file system; the newest valid checkpoint is .*step-00000002"
                                               r"' \(step 2\); once the run directory is writable again, continue "
                                               r"with: scaleloop train --out "):
        train(cfg, DistEnv(), log=lambda _msg: None)


# SimpleNet with 8192 hidden units: a checkpoint of 2.2 MB, of which a 3 MB disk holds one.
BIG = ["--data", "random", "--hidden-dim", "8192", "--checkpoint-every", "5", "--max-steps", "12",
       "--no-progress", "--no-tensorboard", "--device", "cpu"]


def test_a_full_disk_refuses_the_checkpoint_before_writing_it_and_the_run_continues_once_freed(
        small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = small_disk / "run"
    code = main(["train", *BIG, "--out", str(run)])
    out, err = capsys.readouterr()
    root = run / "checkpoints"
    assert code == 2, err
    assert re.fullmatch(
        rf"scaleloop: error: cannot write '{root}/step-00000010': disk full \(it needs 2\.\d MB, [\d.]+ KB free\); "
        rf"the newest valid checkpoint is '{root}/step-00000005' \(step 5\); once space is freed, continue with: "
        rf"scaleloop train --out {run}\n", err), err
    assert "Traceback" not in out + err
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005"]
    assert (root / "latest").read_text().strip() == "step-00000005"
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["kind"], failure["during"]) == ("unwritable", "writing the checkpoint of step 10")
    assert "disk full" in failure["message"]
    told = diagnose(run)
    assert told.state == "unwritable" and "disk full (it needs 2." in told.what
    assert told.checkpoint is not None and told.checkpoint.step == 5

    # With room again, the documented command continues from step 5 to the weights of a run never stopped.
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)
    assert main(["train", "--out", str(run)]) == 0
    assert f"resuming from {root}/step-00000005" in capsys.readouterr().out
    assert main(["train", *BIG, "--out", str(tmp_path / "whole")]) == 0
    resumed, whole = (torch.load(d / "model.pt", weights_only=True) for d in (run, tmp_path / "whole"))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_sharded_write_that_fills_the_disk_part_way_is_an_enospc_on_every_rank(small_disk: Path) -> None:
    # torch.distributed.checkpoint (fsdp; pipeline with sharded checkpoints), here as one process:
    # torch.save reports the short write as a RuntimeError inside DCP's own BaseException.
    from scaleloop.strategies import distcp

    model = nn.Linear(1024, 1024)   # 4 MB of weights on a 3 MB disk
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OSError) as caught:
        distcp.save_state(model, optimizer, small_disk / "checkpoint")
    assert caught.value.errno == errno.ENOSPC


def test_a_sharded_write_failure_keeps_a_ranks_os_error_and_names_any_other(tmp_path: Path) -> None:
    from scaleloop.strategies.distcp import write_failure

    denied = PermissionError(errno.EACCES, "Permission denied", "x/__1_0.distcp")
    assert write_failure({0: (RuntimeError("pos"), None), 1: (denied, None)}, tmp_path) is denied
    other = write_failure({1: (RuntimeError("the storage layer\n failed"), None)}, tmp_path)   # a disk with room
    assert (other.errno, other.strerror) == (errno.EIO, "torch.distributed.checkpoint could not write it "
                                                        "(the storage layer failed)")
