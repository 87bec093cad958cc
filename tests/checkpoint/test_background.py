"""``--async-checkpoint`` in one process: the host copy a background write is made from, and a
write that fails in the background ending the run in the synchronous path's one line."""
from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
import torch

from scaleloop.checkpoint.background import host_copy
from scaleloop.commands.doctor import diagnose
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.dist import DistEnv

from test_write_errors import fail_at_step


def test_the_host_copy_is_the_state_s_own_and_keeps_shared_storages_shared() -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"a": weight, "tied": weight.detach(), "row": weight[1]},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
             "rng": [(3, (1, 2), None)], "config": {"seed": 0}}
    copy = host_copy(state)
    weight.add_(100.0)   # training goes on in place
    assert torch.equal(copy["model"]["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(copy["model"]["row"], torch.tensor([3.0, 4.0, 5.0]))
    shared = copy["model"]["a"].untyped_storage().data_ptr()
    assert copy["model"]["tied"].untyped_storage().data_ptr() == shared == copy["model"]["row"].untyped_storage().data_ptr()
    assert shared != weight.untyped_storage().data_ptr()
    assert copy["optimizer"] == {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    assert copy["rng"] == [(3, (1, 2), None)] and copy["optimizer"]["param_groups"] is not state["optimizer"]["param_groups"]


def test_a_background_write_that_fills_the_disk_ends_the_run_in_the_same_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_at_step(monkeypatch, 4, errno.ENOSPC)   # in the writer thread, part-way through state.pt
    cfg = TrainConfig(data="random", n_samples=512, epochs=1, batch_size=64, out=str(tmp_path / "run"),
                      progress=False, tensorboard=False, device="cpu", checkpoint_every=2,
                      async_checkpoint=True).validate()
    with pytest.raises(RunDirWriteError) as caught:
        train(cfg, DistEnv(), log=lambda _msg: None)
    root = Path(cfg.out) / "checkpoints"
    assert re.fullmatch(   # what the synchronous path says (tests/checkpoint/test_write_errors.py)
        rf"cannot write '{root}/step-00000004': disk full \(it needs [\d.]+ KB, [\d.]+ [KMGT]?B "
        rf"free\); the newest valid checkpoint is '{root}/step-00000002' \(step 2\); once space is freed, continue "
        rf"with: scaleloop train --out {cfg.out}", str(caught.value)), str(caught.value)
    # Raised at the next wait (the checkpoint of step 6), before that one was begun.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]
    assert (root / "latest").read_text().strip() == "step-00000002"
    told = diagnose(Path(cfg.out))
    assert told.state == "unwritable" and told.what == f"stopped while writing the checkpoint of step 4: {caught.value}"
    assert told.checkpoint is not None and told.checkpoint.step == 2
