"""``--async-checkpoint`` in one process: the host copy a background write is made from, a
write that fails in the background ending the run in the synchronous path's one line, and the
warning of a write that another rank's loss cut short, in plain words."""
from __future__ import annotations

import errno
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scaleloop.checkpoint.background import BackgroundWrite, InFlight, Outcome, host_copy, why_not_written
from scaleloop.checkpoint.manager import Checkpointer
from scaleloop.checkpoint.settings import CheckpointSettings
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
    root = Path(cfg.checkpointing.out) / "checkpoints"
    assert re.fullmatch(   # what the synchronous path says (tests/checkpoint/test_write_errors.py)
        rf"cannot write '{root}/step-00000004': disk full \(it needs [\d.]+ KB, [\d.]+ [KMGT]?B "
        rf"free\); the newest valid checkpoint is '{root}/step-00000002' \(step 2\); once space is freed, continue "
        rf"with: scaleloop train --out {cfg.checkpointing.out}", str(caught.value)), str(caught.value)
    # Raised at the next wait (the checkpoint of step 6), before that one was begun.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]
    assert (root / "latest").read_text().strip() == "step-00000002"
    told = diagnose(Path(cfg.checkpointing.out))
    assert told.state == "unwritable" and told.what == f"stopped while writing the checkpoint of step 4: {caught.value}"
    assert told.checkpoint is not None and told.checkpoint.step == 2


#: What Gloo raised on rank 0 when rank 1 was SIGKILLed mid-write of a --mesh fsdp=2 checkpoint
#: (torch 2.13, seen by hand), and what it says when the peer's socket closes cleanly.
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:14007: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️")
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:20660"
NCCL_REMOTE = ("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there was "
               "a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error")
PEER_LOST = "another rank was lost during the write (its process ended or its connection closed)"


@pytest.mark.parametrize("text", [GLOO_RESET, GLOO_CLOSED, NCCL_REMOTE])
def test_a_peer_lost_during_a_write_is_said_in_plain_words(text: str) -> None:
    assert why_not_written(RuntimeError(text)) == PEER_LOST


def test_another_failure_keeps_its_first_line_without_the_library_s_source_place() -> None:
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
                           "for recv operation to complete\nmore detail")
    assert why_not_written(timeout) == "RuntimeError: Timed out waiting 1800000ms for recv operation to complete"
    assert why_not_written(ValueError()) == "ValueError"


def test_the_warning_of_a_write_that_lost_its_peer_names_no_library_text() -> None:
    said: list[str] = []
    checkpointer = Checkpointer(SimpleNamespace(env=DistEnv()), CheckpointSettings(), {}, seed=0, say=said.append)

    def lost_peer() -> Outcome:   # DCP's wait for the shards, in the writer thread, as Gloo raised it
        raise RuntimeError(GLOO_RESET)

    write = BackgroundWrite(6, lost_peer)
    checkpointer._pending = InFlight(6, 3, write.wait, write)   # as save() leaves a write in flight
    checkpointer.wait_alone()   # an exception is leaving the loop (the lost peer's, on the training thread)
    assert said == [f"warning: the checkpoint of step 6 was not written: {PEER_LOST}"]
    assert checkpointer.last_step == 3
