"""A checkpoint that cannot be written (disk full, read-only run directory) ends the run with one
line naming the file, the space needed, the newest valid checkpoint and how to continue; nothing
of the failed checkpoint is left, and ``latest`` still names the last good one."""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from scaleloop.checkpoint import store
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
    fail_at_step(monkeypatch, 4, errno.ENOSPC)
    cfg = config(tmp_path)
    with pytest.raises(RunDirWriteError) as caught:
        train(cfg, DistEnv(), log=lambda _msg: None)
    root = Path(cfg.out) / "checkpoints"
    assert re.fullmatch(
        rf"cannot write '{root}/step-00000004/state.pt': no space left on device \(it needs [\d.]+ KB, [\d.]+ [KMGT]?B "
        rf"free\); the newest valid checkpoint is '{root}/step-00000002' \(step 2\); once space is freed, continue "
        rf"with: scaleloop train --out {cfg.out}", str(caught.value)), str(caught.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]   # no .tmp-step-... left
    assert (root / "latest").read_text().strip() == "step-00000002"
    told = diagnose(Path(cfg.out))   # the loop's record of the ending, read from the directory alone
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
