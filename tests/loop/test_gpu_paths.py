"""What a training run on a GPU must get right that a CPU cannot show: model.pt on the CPU for
every strategy, the peak CUDA memory of this run only, one-rank FSDP on an indexed GPU.

The CUDA tests skip here; ``make gpu-check`` runs this file on a GPU. The CPU tests check the
same code paths where they cost nothing (the peak reset and the clock are no-ops on the CPU).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.loop.training import RunResult, train
from scaleloop.output.footprint import reset_peak
from scaleloop.runtime.dist import DistEnv

HAS_CUDA = torch.cuda.is_available()


def _train(tmp_path: Path, name: str, device: str, **changes) -> RunResult:
    values = dict(data="random", n_samples=256, epochs=1, batch_size=64, out=str(tmp_path / name), progress=False,
                  tensorboard=False, device=device, checkpoints=False)
    values.update(changes)
    return train(TrainConfig(**values).validate(), DistEnv(device=torch.device(device)), log=lambda _m: None)


def test_reset_peak_is_free_on_the_cpu() -> None:
    reset_peak(torch.device("cpu"))   # nothing to reset, and no CUDA call on a machine without it


def test_model_pt_loads_on_the_cpu_without_map_location(tmp_path: Path) -> None:
    result = _train(tmp_path, "cpu", "cpu")
    assert result.run_dir is not None
    state = torch.load(result.run_dir / "model.pt", weights_only=True)
    assert state and {t.device.type for t in state.values()} == {"cpu"}


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_model_pt_holds_cpu_tensors_after_cuda_training(tmp_path: Path, strategy: str) -> None:
    result = _train(tmp_path, strategy, "cuda", strategy=strategy)
    assert result.run_dir is not None
    state = torch.load(result.run_dir / "model.pt", weights_only=True)   # no map_location: must not need one
    assert state and {t.device.type for t in state.values()} == {"cpu"}


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_peak_cuda_memory_is_this_runs_own(tmp_path: Path) -> None:
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")   # 256 MiB, far above the small run
    del big
    result = _train(tmp_path, "small", "cuda")
    [rank] = result.memory
    assert rank.peak_cuda is not None and rank.peak_cuda < 256 * 2**20


# A fresh process: cuBLAS reads its workspace setting when it starts, so deterministic mode
# must come before any CUDA work (pytest's process has done some).
_RESUME_SCRIPT = """
import sys
from scaleloop.runtime.devices import use_deterministic_cuda
use_deterministic_cuda()
from scaleloop.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_resume_equals_uninterrupted_bit_for_bit_on_cuda_in_deterministic_mode(tmp_path: Path) -> None:
    flags = ["train", "--device", "cuda", "--model", "convnet", "--data", "images", "--image-size", "8",
             "--n-samples", "256", "--batch-size", "32", "--epochs", "2", "--no-progress", "--no-tensorboard",
             "--tracker", "none"]

    def cli(*argv: str) -> None:
        res = subprocess.run([sys.executable, "-c", _RESUME_SCRIPT, *flags, *argv], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ))
        assert res.returncode == 0, res.stderr[-2000:]

    cli("--out", str(tmp_path / "straight"), "--checkpoint-every", "11")   # one inside the second epoch
    cli("--out", str(tmp_path / "resumed"), "--resume", str(tmp_path / "straight" / "checkpoints" / "step-00000011"))
    straight = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
