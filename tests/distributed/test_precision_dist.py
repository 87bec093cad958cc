"""Mixed precision and clipping under DDP, and DataParallel where GPUs exist."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
import torch

from procs import scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = ["train", "--data", "random", "--n-samples", "1024", "--epochs", "2", "--batch-size", "64",
        "--no-progress", "--no-tensorboard"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ddp_mixed_precision_with_clipping_trains(tmp_path: Path, precision: str) -> None:
    out = tmp_path / precision
    # --device cpu: two processes cannot share one GPU (a 1-GPU machine runs this file in gpu-check)
    res = scaleloop([*BASE, "--nproc", "2", "--strategy", "ddp", "--precision", precision, "--device", "cpu",
                     "--clip-grad", "1.0", "--accumulate", "2", "--out", str(out)], cwd=tmp_path)
    assert re.search(rf"^  precision\s+{precision}$", res.stdout, re.M), res.stdout
    epochs = [r for r in csv.DictReader(open(out / "metrics.csv")) if r["kind"] == "epoch"]
    losses = [float(r["train_loss"]) for r in epochs]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert float(epochs[-1]["test_acc"]) > 0.8


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="nn.DataParallel equivalence needs at least 2 CUDA GPUs")
def test_dataparallel_equals_single_gpu(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    args = [*BASE, "--epochs", "1", "--max-steps", "6", "--optimizer", "sgd", "--lr", "0.1", "--device", "cuda"]
    scaleloop([*args, "--strategy", "single", "--out", str(tmp_path / "one")], cwd=tmp_path)
    scaleloop([*args, "--strategy", "dp", "--out", str(tmp_path / "dp")], cwd=tmp_path)
    a = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "dp" / "model.pt", weights_only=True)
    scale = max(t.abs().max().item() for t in a.values())
    assert max((a[k] - b[k]).abs().max().item() for k in a) / scale <= 1e-5
