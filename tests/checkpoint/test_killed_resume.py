"""``scaleloop train --out DIR`` continues a killed run with the settings saved in DIR, never others.

A run is killed (SIGKILL to its process group) before its first checkpoint, while writing it,
and after it. ``scaleloop train --out DIR`` then trains with DIR/config.toml's settings (from the
start when no checkpoint was kept), leaving config.toml as it was, and ends with the weights of
the same run never interrupted, bit for bit; or it refuses in one line. Before, a run killed
before its first checkpoint was taken over by the defaults (issue 41).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from procs import ForkedRun, child_env, kill_group, run  # noqa: E402
from scaleloop.config import load_toml  # noqa: E402

# Not the defaults (hidden 128, 20 epochs), and a checkpoint of about 80 MB: its write takes a while.
# Its size is the hidden layer's; the training's cost, the batch's: 10 steps of 8 samples (of 64,
# the forward and backward passes over 300,000 hidden units were most of this file's CPU time).
SETTINGS = ["--data", "random", "--n-samples", "80", "--batch-size", "8", "--epochs", "1", "--hidden-dim", "300000",
            "--checkpoint-every", "5", "--no-progress", "--no-tensorboard", "--device", "cpu"]
RUN_S = 300


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "scaleloop", "train", *args], cwd=cwd, timeout=RUN_S,
               env=child_env({"OMP_NUM_THREADS": "1"}))


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("whole") / "run"
    res = train(*SETTINGS, "--out", str(out), cwd=out.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def checkpoints(out: Path, pattern: str) -> list[Path]:
    return sorted((out / "checkpoints").glob(pattern)) if (out / "checkpoints").is_dir() else []


MOMENTS: dict[str, Callable[[Path], bool]] = {
    "before": lambda out: (out / "config.toml").is_file(),
    "during": lambda out: bool(checkpoints(out, ".tmp-step-*")),
    "after": lambda out: (out / "checkpoints" / "step-00000005").is_dir(),
}


def killed_at(moment: str, out: Path) -> None:
    """Start the run as a user does (``scaleloop train``; a fork of the tests' fork server, as the
    continuing runs are), and SIGKILL its process group at ``moment``."""
    proc = ForkedRun([sys.executable, "-m", "scaleloop", "train", *SETTINGS, "--out", str(out)], cwd=out.parent,
                     env=child_env({"OMP_NUM_THREADS": "1"}), timeout=RUN_S)
    try:
        deadline = time.monotonic() + RUN_S
        while not MOMENTS[moment](out):
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before the moment {moment!r}"
            assert time.monotonic() < deadline, f"no moment {moment!r} within {RUN_S} s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        kill_group(proc)


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_killed_run_continues_with_its_saved_settings(tmp_path: Path, whole: Path, moment: str) -> None:
    out = tmp_path / "run"
    killed_at(moment, out)
    saved = (out / "config.toml").read_bytes()
    complete = checkpoints(out, "step-*")
    # The kill came at the moment named: no checkpoint before and during its write, one after.
    assert bool(complete) == (moment == "after"), complete
    if moment == "during":
        assert checkpoints(out, ".tmp-step-*")

    res = train("--out", str(out), cwd=tmp_path)

    assert (out / "config.toml").read_bytes() == saved
    if res.returncode != 0:   # refused: one line, saying why
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("scaleloop: error: "), res.stderr
        return
    assert "starts over" in res.stderr if moment != "after" else "resuming from" in res.stdout, res.stdout + res.stderr
    settings = load_toml(out / "config.toml")
    assert settings == {**load_toml(whole / "config.toml"), "out": str(out)}
    expected = torch.load(whole / "model.pt", weights_only=True)
    got = torch.load(out / "model.pt", weights_only=True)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "the continued run's weights differ"
