"""A machine's copy of a checkpoint: written atomically, verified against rank 0's manifest."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.checkpoint.replicas import _read_all
from scaleloop.checkpoint.store import CheckpointError, list_checkpoints, verify_checkpoint, write_checkpoint


def written(root: Path, step: int = 8) -> Path:
    return write_checkpoint(root, step, {"state.pt": b"weights" * 100, "__0_0.distcp": b"\x01\x02"},
                            {"epoch": 0, "world_size": 3})


def test_a_copy_is_the_same_checkpoint(tmp_path: Path) -> None:
    from scaleloop.checkpoint.store import copy_checkpoint

    original = written(tmp_path / "machine0" / "checkpoints")
    files = _read_all(original)["files"]
    assert set(files) == {"state.pt", "__0_0.distcp", "manifest.json"}
    copy = copy_checkpoint(tmp_path / "machine1" / "checkpoints", 8, files)
    assert copy.step == 8 and copy.path.name == "step-00000008"
    assert verify_checkpoint(copy.path).meta == verify_checkpoint(original).meta
    assert (copy.path.parent / "latest").read_text().strip() == "step-00000008"
    # The same step again (a resumed run that ends where it resumed) replaces it whole.
    assert copy_checkpoint(tmp_path / "machine1" / "checkpoints", 8, files).path == copy.path


def test_a_damaged_copy_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    from scaleloop.checkpoint.store import copy_checkpoint

    files = dict(_read_all(written(tmp_path / "machine0" / "checkpoints"))["files"])
    files["state.pt"] = files["state.pt"][:-1] + b"X"        # a byte changed on the way
    root = tmp_path / "machine1" / "checkpoints"
    with pytest.raises(CheckpointError, match="corrupt"):
        copy_checkpoint(root, 8, files)
    assert list_checkpoints(root) == [] and not any(root.iterdir())
