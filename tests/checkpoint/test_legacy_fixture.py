"""Checkpoints written by an earlier scaleloop still resume, and exactly.

The fixtures were written on 2026-11-23 by the main branch of that day (before the step and
the package layout were rewritten): ``scaleloop train --epochs 2 --batch-size 128
--checkpoint-every 5 --max-steps 7``, once as one process and once as ``--nproc 2 --strategy
fsdp`` (sharded, torch.distributed.checkpoint files). Step 7 is inside the first epoch.

The fixtures' first 7 steps ran on another machine's CPU, whose matmul kernels may round
differently (an Intel machine wrote them; an AMD one rounds the same run 1.8e-7 apart). So the
state a fixture holds is checked bit for bit where it is loaded, and the 5 steps trained after it
against a run trained here from scratch within a tolerance far below what a lost optimizer
state, RNG state or data position would cause.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaleloop.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoints-2026-11-23"
COMMON = ["--epochs", "2", "--batch-size", "128", "--max-steps", "12", "--no-progress"]
#: The fixtures were trained with 2 intra-op threads; a matmul's rounding depends on the count.
THREADS = 2


def _train(argv: list[str]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        assert main(["train", *argv]) == 0
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("uninterrupted")
    _train(["--out", str(out), "--no-checkpoints", *COMMON])
    return torch.load(out / "model.pt", weights_only=True)


def _resume(checkpoint: str, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    _train(["--resume", str(FIXTURES / checkpoint), "--out", str(out), *COMMON, *extra])
    return torch.load(out / "model.pt", weights_only=True)


def test_single_process_checkpoint_loads_bit_for_bit(tmp_path: Path, capsys) -> None:
    # --max-steps 7 leaves nothing to train: model.pt holds the weights exactly as loaded.
    _train(["--resume", str(FIXTURES / "single-step7"), "--out", str(tmp_path / "run"),
            *[a for a in COMMON if a not in ("--max-steps", "12")], "--max-steps", "7"])
    assert "nothing left to train: the run already reached step 7 (--max-steps 7)" in capsys.readouterr().out
    loaded = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    saved = torch.load(FIXTURES / "single-step7" / "state.pt", weights_only=True)["model"]
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_single_process_checkpoint_resumes(tmp_path: Path, uninterrupted, capsys) -> None:
    resumed = _resume("single-step7", tmp_path / "run")
    assert "global step 7: epoch 1, step 7 of 12" in capsys.readouterr().out
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-6)


def test_sharded_fsdp_checkpoint_resumes_on_one_process(tmp_path: Path, uninterrupted, capsys) -> None:
    resumed = _resume("fsdp2-step7", tmp_path / "run", "--strategy", "single")
    assert "written by 2 process(es), this run has 1" in capsys.readouterr().out
    for key, value in uninterrupted.items():
        # The two ranks' all-reduced gradient sums differ from one process's in rounding only.
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-6)
