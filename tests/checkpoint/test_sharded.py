"""Sharded (torch.distributed.checkpoint) checkpoints, in one process: layout, checks, errors.

``dcp.save``/``dcp.load`` run here without a process group (as one process); the multi-rank
runs are in tests/distributed/test_fsdp.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaleloop.checkpoint.store import (CheckpointError, begin_checkpoint, finish_checkpoint,
                                        verify_checkpoint)
from scaleloop.runtime.dist import DistEnv
from scaleloop.models import SimpleNet
from scaleloop.strategies import SingleDevice, distcp

STRATEGY = SingleDevice(DistEnv())
SHARDED = {"sharded": distcp.SHARDED_FORMAT}   # what state.pt holds of a sharded checkpoint's model


def load(model: SimpleNet, directory: Path) -> None:
    STRATEGY.load_checkpoint(model, torch.optim.Adam(model.parameters()), SHARDED, directory)


def saved(tmp_path: Path, hidden: int = 8) -> tuple[Path, SimpleNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SimpleNet(4, hidden, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    directory = tmp_path / "dcp"
    distcp.save_state(model, optimizer, directory)
    return directory, model, optimizer


def test_manifest_covers_files_that_other_writers_put_into_the_temp_dir(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    tmp = begin_checkpoint(root, 7)
    (tmp / "__1_0.distcp").write_bytes(b"rank 1's shards")
    (tmp / ".metadata").write_bytes(b"where everything is")
    path = finish_checkpoint(root, 7, tmp, {"state.pt": b"the rest"}, {"sharded": "x"})
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"state.pt", "__1_0.distcp", ".metadata"}
    assert (root / "latest").read_text().strip() == "step-00000007" and not tmp.exists()
    (path / "__1_0.distcp").write_bytes(b"rank 1's shardz")
    with pytest.raises(CheckpointError, match="__1_0.distcp.* is corrupt"):
        verify_checkpoint(path)


def test_round_trip_into_a_fresh_model_and_optimizer(tmp_path: Path) -> None:
    directory, model, optimizer = saved(tmp_path)
    torch.manual_seed(1)
    fresh = SimpleNet(4, 8, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    STRATEGY.load_checkpoint(fresh, fresh_opt, SHARDED, directory)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key
    a, b = optimizer.state_dict(), fresh_opt.state_dict()
    assert b["param_groups"][0]["lr"] == 0.1
    for i, state in a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["state"][i][name]), (i, name)


def test_a_missing_shard_is_reported_as_a_shared_file_system_problem(tmp_path: Path) -> None:
    directory, _, _ = saved(tmp_path)
    assert distcp.missing_shards(directory) is None
    (directory / "__0_0.distcp").unlink()
    message = distcp.missing_shards(directory)
    assert message is not None and "__0_0.distcp" in message and "file system that all nodes share" in message


def test_a_checkpoint_a_rank_cannot_see_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match=r"not visible to rank\(s\) 0: .*share"):
        load(SimpleNet(4, 8, 2), tmp_path / "elsewhere")


def test_a_checkpoint_of_another_model_names_the_shapes(tmp_path: Path) -> None:
    directory, _, _ = saved(tmp_path, hidden=8)
    load(SimpleNet(4, 8, 2), directory)
    with pytest.raises(CheckpointError, match=r"net.0.weight \(8, 4\) vs \(16, 4\)"):
        load(SimpleNet(4, 16, 2), directory)
