"""Tests for scaleloop.checkpoint.store: atomic layout, manifests, verification, pruning, locate."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from scaleloop.checkpoint.store import (FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, STATE_FILE,
                                        CheckpointError, list_checkpoints, locate, newest_valid, prune,
                                        run_dir_of, step_dir_name, verify_checkpoint, write_checkpoint)
from scaleloop.errors import UsageError

# A pid that is not this process's: what a writer killed earlier leaves behind.
DEAD_PID = os.getpid() + 1


def payload(step: int, size: int = 4096) -> bytes:
    return bytes((step * 31 + i) % 251 for i in range(size))


def save(root: Path, step: int, size: int = 4096) -> Path:
    return write_checkpoint(root, step, {STATE_FILE: payload(step, size)}, {"epoch": step // 10, "note": "x"})


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


# --- writing ------------------------------------------------------------------------------

def test_write_creates_step_dir_with_state_and_manifest(root: Path) -> None:
    data = payload(40)
    path = write_checkpoint(root, 40, {STATE_FILE: data}, {"epoch": 2, "world_size": 1})
    assert path == root / "step-00000040" == root / step_dir_name(40)
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_FILE, STATE_FILE]
    assert (path / STATE_FILE).read_bytes() == data
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["step"] == 40 and manifest["epoch"] == 2 and manifest["world_size"] == 1
    assert manifest["files"] == {STATE_FILE: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    assert (root / LATEST_FILE).read_text().strip() == "step-00000040"
    info = verify_checkpoint(path)
    assert info.path == path and info.step == 40 and info.meta["epoch"] == 2
    assert info.state_file == path / STATE_FILE
    # nothing temporary is left next to it
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step-00000040"]


def test_latest_moves_to_each_new_checkpoint(root: Path) -> None:
    save(root, 10)
    assert (root / LATEST_FILE).read_text().strip() == "step-00000010"
    save(root, 20)
    assert (root / LATEST_FILE).read_text().strip() == "step-00000020"
    assert list_checkpoints(root) == [root / "step-00000020", root / "step-00000010"]


def test_resaving_the_same_step_replaces_it_cleanly(root: Path) -> None:
    save(root, 30, size=1000)
    path = write_checkpoint(root, 30, {STATE_FILE: b"new contents"}, {"epoch": 9})
    assert (path / STATE_FILE).read_bytes() == b"new contents"
    info = verify_checkpoint(path)
    assert info.meta["epoch"] == 9 and info.meta["files"][STATE_FILE]["bytes"] == len(b"new contents")
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step-00000030"]


# --- a write killed half-way ----------------------------------------------------------------

def test_partial_temp_dir_leaves_previous_checkpoint_newest(root: Path) -> None:
    save(root, 10)
    # A writer killed while writing step 20: half a state file, no manifest, never renamed.
    tmp = root / f".tmp-step-00000020-{DEAD_PID}"
    tmp.mkdir()
    (tmp / STATE_FILE).write_bytes(payload(20)[:2048])
    assert list_checkpoints(root) == [root / "step-00000010"]
    warnings: list[str] = []
    found = newest_valid(root, warnings.append)
    assert found is not None and found.step == 10
    assert warnings == []  # a temporary directory is not a checkpoint, so nothing to warn about
    assert (root / LATEST_FILE).read_text().strip() == "step-00000010"
    assert locate(root.parent) == root / "step-00000010"

    removed = prune(root, keep=3)
    assert removed == [tmp]
    assert not tmp.exists()
    assert (root / "step-00000010").is_dir() and verify_checkpoint(root / "step-00000010").step == 10


def test_next_write_cleans_up_a_dead_writers_temp_dir(root: Path) -> None:
    tmp = root / f".tmp-step-00000020-{DEAD_PID}"
    tmp.mkdir(parents=True)
    (tmp / STATE_FILE).write_bytes(b"half")
    save(root, 10)
    save(root, 20)
    prune(root, keep=5)
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step-00000010", "step-00000020"]


# --- verification ----------------------------------------------------------------------------

def test_truncated_state_file_is_named(root: Path) -> None:
    path = save(root, 10)
    state = path / STATE_FILE
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    msg = one_line(exc)
    assert str(state) in msg and "truncated" in msg and "1000 bytes" in msg


def test_flipped_byte_with_same_size_is_corrupt(root: Path) -> None:
    path = save(root, 10)
    state = path / STATE_FILE
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    msg = one_line(exc)
    assert str(state) in msg and "corrupt" in msg and "SHA-256" in msg


def test_missing_manifest_is_an_error(root: Path) -> None:
    path = save(root, 10)
    (path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    msg = one_line(exc)
    assert str(path) in msg and MANIFEST_FILE in msg


def test_missing_state_file_is_named(root: Path) -> None:
    path = save(root, 10)
    (path / STATE_FILE).unlink()
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    assert str(path / STATE_FILE) in one_line(exc) and "missing" in str(exc.value)


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],                 # cut short: invalid JSON
    lambda text: "not json at all",
    lambda text: json.dumps({"format_version": 1}),      # valid JSON, no step or files
    lambda text: json.dumps(["a", "list"]),
])
def test_damaged_manifest_names_the_manifest(root: Path, damage) -> None:
    path = save(root, 10)
    manifest = path / MANIFEST_FILE
    manifest.write_text(damage(manifest.read_text()))
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    msg = one_line(exc)
    assert str(manifest) in msg and "damaged" in msg


def test_newer_format_version_asks_to_upgrade(root: Path) -> None:
    path = save(root, 10)
    manifest = path / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(path)
    msg = one_line(exc)
    assert str(path) in msg and f"format version {FORMAT_VERSION + 1}" in msg and "upgrade" in msg


def test_nonexistent_checkpoint_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(tmp_path / "step-00000099")
    assert "does not exist" in one_line(exc)


def test_checkpoint_error_is_a_usage_error() -> None:
    # so the CLI reports it in one line with exit code 2
    assert issubclass(CheckpointError, UsageError)


# --- newest valid, pruning ---------------------------------------------------------------

def test_newest_valid_falls_back_and_warns_naming_the_bad_file(root: Path) -> None:
    save(root, 10)
    save(root, 20)
    bad = save(root, 30) / STATE_FILE
    bad.write_bytes(bad.read_bytes()[:-1])
    warnings: list[str] = []
    found = newest_valid(root, warnings.append)
    assert found is not None and found.step == 20 and found.path == root / "step-00000020"
    assert len(warnings) == 1
    assert "\n" not in warnings[0] and str(bad) in warnings[0] and warnings[0].startswith("warning:")


def test_newest_valid_none_when_all_bad_or_none(root: Path) -> None:
    assert newest_valid(root, lambda m: pytest.fail(m)) is None  # no directory at all
    for step in (10, 20):
        (save(root, step) / MANIFEST_FILE).unlink()
    warnings: list[str] = []
    assert newest_valid(root, warnings.append) is None
    assert len(warnings) == 2


def test_prune_keeps_the_k_newest(root: Path) -> None:
    for step in (5, 10, 15, 20, 25):
        save(root, step)
    removed = prune(root, keep=2)
    assert sorted(removed) == [root / "step-00000005", root / "step-00000010", root / "step-00000015"]
    assert list_checkpoints(root) == [root / "step-00000025", root / "step-00000020"]
    assert (root / LATEST_FILE).read_text().strip() == "step-00000025"
    assert prune(root, keep=2) == []


def test_prune_orders_by_step_number_not_name(root: Path) -> None:
    save(root, 9)
    save(root, 100_000_000)  # wider than the 8-digit padding: still the newest
    save(root, 50)
    prune(root, keep=1)
    assert [p.name for p in list_checkpoints(root)] == ["step-100000000"]


# --- locate --------------------------------------------------------------------------------

def test_locate_accepts_run_dir_checkpoints_step_dir_and_state_file(root: Path) -> None:
    save(root, 10)
    newest = save(root, 20)
    run = root.parent
    assert locate(run) == newest
    assert locate(root) == newest
    assert locate(root / "step-00000010") == root / "step-00000010"
    assert locate(root / "step-00000010" / STATE_FILE) == root / "step-00000010"
    assert locate(newest / MANIFEST_FILE) == newest


def test_locate_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        locate(tmp_path / "nope")
    msg = one_line(exc)
    assert str(tmp_path / "nope") in msg and "does not exist" in msg


def test_locate_directory_without_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        locate(tmp_path)
    assert "holds no checkpoint" in one_line(exc)


def test_run_dir_of(root: Path, tmp_path: Path) -> None:
    step = save(root, 10)
    assert run_dir_of(step) == root.parent
    assert run_dir_of(tmp_path / "loose" / "step-00000010") is None
