"""Tests for scaleloop.checkpoint.state: weights-only (de)serialisation, RNG states, the shape check."""
from __future__ import annotations

import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleloop.checkpoint.state import (capture_rng, check_model_state, from_bytes, restore_rng,
                                        to_bytes)
from scaleloop.checkpoint.store import STATE_FILE, CheckpointError, write_checkpoint
from scaleloop.cli import main
from scaleloop.models import SimpleNet

CPU = torch.device("cpu")


class Smuggled:
    """A pickled object whose unpickling would call print (harmless stand-in for os.system)."""

    def __reduce__(self):
        return (print, ("pwned",))


class PlainObject:
    def __init__(self) -> None:
        self.value = 3


def pickled_state(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2)}, "extra": obj}, buf)
    return buf.getvalue()


# --- serialisation -------------------------------------------------------------------------

def test_round_trip_of_tensors_and_plain_values() -> None:
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(4)},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "progress": {"epoch": 1, "step_in_epoch": 3, "global_step": 11, "samples": 1100, "train_s": 1.5},
        "rng": [capture_rng(CPU)],
        "config": {"model": "simplenet", "max_steps": None, "progress": False},
        "tuple": (1, "a", 2.5),
    }
    back = from_bytes(to_bytes(state), "test")
    assert back.keys() == state.keys()
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["model"]["b"], state["model"]["b"])
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert back["progress"] == state["progress"] and back["config"] == state["config"]
    assert back["tuple"] == (1, "a", 2.5)
    assert torch.equal(back["rng"][0]["torch"], state["rng"][0]["torch"])


@pytest.mark.parametrize("obj", [Smuggled(), PlainObject()], ids=["reduce-to-print", "class-instance"])
def test_pickled_objects_are_refused(capsys: pytest.CaptureFixture[str], obj: object) -> None:
    data = pickled_state(obj)
    with pytest.raises(CheckpointError) as exc:
        from_bytes(data, "evil/state.pt")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "evil/state.pt" in msg and "weights-only" in msg
    assert "pwned" not in capsys.readouterr().out  # nothing in the file was executed


def test_the_smuggled_object_really_would_run() -> None:
    # Guards the test above: a plain (unsafe) load of the same bytes does call print.
    buf = io.StringIO()
    old, sys.stdout = sys.stdout, buf
    try:
        torch.load(io.BytesIO(pickled_state(Smuggled())), weights_only=False)
    finally:
        sys.stdout = old
    assert "pwned" in buf.getvalue()


def test_garbage_bytes_are_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError) as exc:
        from_bytes(b"definitely not a torch file", "x/state.pt")
    assert "x/state.pt" in str(exc.value) and "\n" not in str(exc.value)


def test_non_scaleloop_state_is_refused() -> None:
    with pytest.raises(CheckpointError) as exc:
        from_bytes(to_bytes({"weights": torch.zeros(1)}), "other.pt")
    assert "other.pt" in str(exc.value) and "not a scaleloop checkpoint" in str(exc.value)


def test_resume_from_a_checkpoint_with_pickled_code_exits_2(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    # A checkpoint whose manifest is valid (right size and SHA-256) but whose state smuggles code.
    ckpt = write_checkpoint(tmp_path / "evil", 5, {STATE_FILE: pickled_state(Smuggled())}, {"epoch": 0})
    out_dir = tmp_path / "out"
    code = main(["train", "--resume", str(ckpt), "--out", str(out_dir), "--data", "random",
                 "--n-samples", "64", "--epochs", "1", "--no-progress", "--no-tensorboard", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scaleloop: error: ") and "weights-only" in lines[0] and str(ckpt) in lines[0]
    assert "Traceback" not in out + err and "pwned" not in out + err
    assert not out_dir.exists()  # refused before the run directory was made


# --- RNG states ----------------------------------------------------------------------------

def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(5)


def test_capture_restore_rng_round_trip() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draws()  # move away from the seeded start
    np.random.randn()  # leave a cached gaussian in numpy's state
    state = capture_rng(CPU)
    expected = draws()
    # through the bytes a checkpoint is made of
    state = from_bytes(to_bytes({"model": {}, "rng": [state]}), "rng")["rng"][0]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert draws()[0] != expected[0]
    restore_rng(state, CPU)
    got = draws()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    # the gaussian cache came back too
    restore_rng(state, CPU)
    a = np.random.randn()
    restore_rng(state, CPU)
    assert np.random.randn() == a


# --- model shape check -----------------------------------------------------------------------

def test_state_of_the_same_model_fits() -> None:
    model = SimpleNet(20, 16, 1)
    check_model_state(model.state_dict(), SimpleNet(20, 16, 1).state_dict(), "ok.pt")


def test_other_hidden_size_names_keys_and_shapes() -> None:
    expected = SimpleNet(20, 16, 1).state_dict()
    saved = SimpleNet(20, 32, 1).state_dict()
    with pytest.raises(CheckpointError) as exc:
        check_model_state(expected, saved, "ckpt/state.pt")
    msg = str(exc.value)
    assert "\n" not in msg and "ckpt/state.pt" in msg and "shape mismatch" in msg
    key = next(k for k in expected if expected[k].shape != saved[k].shape)
    assert key in msg
    assert f"{tuple(saved[key].shape)} vs {tuple(expected[key].shape)}" in msg
    assert "--hidden-dim" in msg


def test_missing_and_unexpected_keys_are_listed() -> None:
    expected = {"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}
    saved = {"a.weight": torch.zeros(2), "c.bias": torch.zeros(2)}
    with pytest.raises(CheckpointError) as exc:
        check_model_state(expected, saved, "s.pt")
    msg = str(exc.value)
    assert "missing from the checkpoint: b.weight" in msg
    assert "not in the model: c.bias" in msg
    assert "shape mismatch" not in msg


def test_long_lists_are_shortened() -> None:
    expected = {f"k{i}": torch.zeros(1) for i in range(10)}
    with pytest.raises(CheckpointError) as exc:
        check_model_state(expected, {}, "s.pt")
    assert "and 6 more" in str(exc.value) and "k9" not in str(exc.value)
