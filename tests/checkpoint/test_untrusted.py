"""Hostile checkpoint files, in one process: nothing in them runs, nothing outside is read.

A file that runs code on a plain load (``hostile.Payload``: it creates a marker file) is put
where a checkpoint holds pickles: DCP's ``.metadata``, a DCP byte entry, ``state.pt``; its
manifest entry is rewritten to match, as an attacker would. The multi-process resumes (fsdp,
``--mesh``) are in tests/distributed/test_fsdp.py and test_mesh_dist.py; the files are made by
tests/distributed/hostile.py.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))   # hostile.py, shared with those tests
from hostile import Payload, name_in_manifest, payload_bytes, rewrite
from scaleloop.checkpoint import untrusted
from scaleloop.checkpoint.store import CheckpointError, verify_checkpoint, write_checkpoint
from scaleloop.checkpoint.state import to_bytes
from scaleloop.cli import main
from scaleloop.models import SimpleNet
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies import SingleDevice, distcp

STRATEGY = SingleDevice(DistEnv())
SHARDED = {"sharded": distcp.SHARDED_FORMAT}
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints-2026-11-23" / "fsdp2-step7"


def sharded_checkpoint(tmp_path: Path, lr: object = 0.1) -> Path:
    """A verified sharded checkpoint (``state.pt`` + DCP files + manifest) of a SimpleNet and Adam."""
    torch.manual_seed(0)
    model = SimpleNet(4, 8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0].update(lr=lr, initial_lr=0.1)   # initial_lr: as a run's schedule adds it
    root = tmp_path / "checkpoints"
    from scaleloop.checkpoint.store import begin_checkpoint, finish_checkpoint

    tmp = begin_checkpoint(root, 3)
    distcp.save_state(model, optimizer, tmp)
    return finish_checkpoint(root, 3, tmp, {"state.pt": to_bytes(SHARDED)}, {"sharded": distcp.SHARDED_FORMAT})


def load(directory: Path) -> None:
    model = SimpleNet(4, 8, 1)
    STRATEGY.load_checkpoint(model, torch.optim.Adam(model.parameters(), lr=0.5), SHARDED, directory)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# --- the payload is live: a plain load runs it ------------------------------------------------

def test_the_payload_runs_under_plain_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(payload_bytes(marker))
    assert marker.exists()


def test_dcp_s_own_reader_runs_a_hostile_metadata(tmp_path: Path) -> None:
    # What this module guards against, shown with torch's own reader: it unpickles .metadata as it is.
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint, marker = sharded_checkpoint(tmp_path), tmp_path / "ran"
    rewrite(checkpoint, ".metadata", payload_bytes(marker))
    FileSystemReader(str(checkpoint)).read_metadata()
    assert marker.exists()


# --- DCP's .metadata ---------------------------------------------------------------------------

def test_real_metadata_passes_the_check_and_loads(tmp_path: Path) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    for path in (checkpoint / ".metadata", FIXTURE / ".metadata"):   # today's and 2026-11-23's
        untrusted.check_metadata(path)
        assert type(untrusted.load_metadata(path)).__name__ == "Metadata"
    assert verify_checkpoint(FIXTURE).step == 7
    load(checkpoint)


def test_a_hostile_metadata_is_refused_by_verify_naming_the_file(tmp_path: Path) -> None:
    checkpoint, marker = sharded_checkpoint(tmp_path), tmp_path / "ran"
    rewrite(checkpoint, ".metadata", payload_bytes(marker))
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(checkpoint)
    message = one_line(exc)
    assert f"refusing to load '{checkpoint}/.metadata'" in message and "nothing in it was run" in message
    assert not marker.exists()


def test_a_hostile_metadata_is_refused_by_the_loader_too(tmp_path: Path) -> None:
    # The load does not rely on verify having run (a checkpoint handed to the library directly).
    checkpoint, marker = sharded_checkpoint(tmp_path), tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(payload_bytes(marker))
    with pytest.raises(CheckpointError, match="refusing to load .*/.metadata'"):
        load(checkpoint)
    assert not marker.exists()


@pytest.mark.parametrize("data", [b"", b"not a pickle at all", pickle.dumps({"a": 1})[:-3]],
                         ids=["empty", "text", "truncated"])
def test_a_metadata_that_is_not_a_pickle_is_one_line(tmp_path: Path, data: bytes) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    rewrite(checkpoint, ".metadata", data)
    with pytest.raises(CheckpointError, match="cannot be read as torch.distributed.checkpoint metadata") as exc:
        verify_checkpoint(checkpoint)
    one_line(exc)


def test_a_metadata_of_another_type_is_refused(tmp_path: Path) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    rewrite(checkpoint, ".metadata", pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match="is not torch.distributed.checkpoint metadata"):
        load(checkpoint)


@pytest.mark.parametrize("target", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp"])
def test_a_metadata_naming_a_data_file_outside_is_refused(tmp_path: Path, target: str) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    metadata = untrusted.load_metadata(checkpoint / ".metadata")
    metadata.storage_data = {key: dataclasses.replace(info, relative_path=target)
                             for key, info in metadata.storage_data.items()}
    rewrite(checkpoint, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file inside its checkpoint directory") as exc:
        load(checkpoint)
    assert target in one_line(exc)


# --- DCP's byte entries ------------------------------------------------------------------------

def test_a_byte_entry_with_a_payload_runs_under_dcp_s_own_planner(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "ran"
    checkpoint = sharded_checkpoint(tmp_path, lr=Payload(marker))
    model = SimpleNet(4, 8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(checkpoint))
    assert marker.exists()


def test_a_byte_entry_with_a_payload_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    checkpoint = sharded_checkpoint(tmp_path, lr=Payload(marker))
    verify_checkpoint(checkpoint)   # the manifest and .metadata are what DCP wrote: only the load can tell
    with pytest.raises(CheckpointError) as exc:
        load(checkpoint)
    message = one_line(exc)
    assert f"refusing to load '{checkpoint}/__0_0.distcp': its entry 'optimizer.param_groups." in message
    assert "nothing in it was run" in message
    assert not marker.exists()


# --- the manifest's names ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../outside.txt", "ABSOLUTE", "sub/../../outside.txt"])
def test_a_manifest_naming_a_file_outside_is_refused_before_opening_it(tmp_path: Path, name: str) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    name = str(outside) if name == "ABSOLUTE" else name
    name_in_manifest(checkpoint, name)
    with pytest.raises(CheckpointError) as exc:
        verify_checkpoint(checkpoint)
    message = one_line(exc)
    assert "not a file inside its checkpoint directory" in message and "bytes" not in message


def test_a_manifest_entry_that_is_a_symlink_out_is_refused(tmp_path: Path) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    outside = tmp_path / "outside.pt"
    outside.write_bytes((checkpoint / "state.pt").read_bytes())
    (checkpoint / "state.pt").unlink()
    os.symlink(outside, checkpoint / "state.pt")   # same bytes: size and SHA-256 still match
    with pytest.raises(CheckpointError, match="names 'state.pt', which is not a file inside"):
        verify_checkpoint(checkpoint)


def test_a_manifest_without_state_pt_is_refused(tmp_path: Path) -> None:
    checkpoint = sharded_checkpoint(tmp_path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["state.pt"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not list state.pt"):
        verify_checkpoint(checkpoint)


# --- through the CLI: --resume PATH into a fresh single-process run -----------------------------

def ddp_as_sharded(tmp_path: Path, marker: Path) -> Path:
    """A whole-state checkpoint (as ddp writes) whose ``state.pt`` was given a ``"sharded"`` entry and
    whose directory a ``.metadata`` with the payload: loading it would go through DCP's reader."""
    model = SimpleNet(4, 8, 1)
    optimizer = torch.optim.Adam(model.parameters())
    checkpoint = write_checkpoint(tmp_path / "checkpoints", 3, {"state.pt": to_bytes(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sharded": distcp.SHARDED_FORMAT})},
        {"epoch": 0})
    rewrite(checkpoint, ".metadata", payload_bytes(marker))
    return checkpoint


@pytest.mark.parametrize("where", [".metadata", "state.pt", "byte entry", "ddp-as-sharded"])
def test_resume_of_a_hostile_checkpoint_exits_2_and_runs_nothing(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path, where: str) -> None:
    marker = tmp_path / "ran"
    checkpoint = sharded_checkpoint(tmp_path, lr=Payload(marker) if where == "byte entry" else 0.1)
    if where == "ddp-as-sharded":
        checkpoint = ddp_as_sharded(tmp_path / "ddp", marker)
    elif where == ".metadata":
        rewrite(checkpoint, ".metadata", payload_bytes(marker))
    elif where == "state.pt":
        buf = io.BytesIO()
        torch.save({"sharded": distcp.SHARDED_FORMAT, "rng": Payload(marker)}, buf)
        rewrite(checkpoint, "state.pt", buf.getvalue())
    out_dir = tmp_path / "out"
    code = main(["train", "--resume", str(checkpoint), "--out", str(out_dir), "--data", "random", "--input-dim", "4",
                 "--hidden-dim", "8", "--n-samples", "64", "--epochs", "1", "--no-progress", "--no-tensorboard",
                 "--device", "cpu", "--optimizer", "adam"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("scaleloop: error: ")]
    assert len(errors) == 1, err
    named = {"state.pt": "state.pt", ".metadata": ".metadata", "ddp-as-sharded": ".metadata"}.get(where, "__0_0.distcp")
    assert f"refusing to load {checkpoint}/{named}" in errors[0].replace("'", ""), err
    assert "was tampered with" in errors[0], err
    assert "Traceback" not in out + err
    assert not marker.exists()
