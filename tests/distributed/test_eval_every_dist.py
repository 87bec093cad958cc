"""--eval-every with --eval-batches and --eval-train on 2 Gloo processes reports what 1 process does.

Both runs read the same fixed samples (drawn from --seed alone), and the evaluation sums over
them exactly; the weights of DDP at 2 processes and of one process agree to rounding, so the
evaluated losses agree to about 1e-6.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from procs import scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 1000 samples (200 test), batch 64: an uneven sample of 3 x 64 = 192 of the 200 test samples.
ARGS = ["--data", "random", "--n-samples", "1000", "--model", "simplenet", "--epochs", "1", "--max-steps", "6",
        "--no-progress", "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "64",
        "--eval-every", "2", "--eval-batches", "3", "--eval-train", "--log-every", "3"]


def eval_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return {int(r["step"]): r for r in csv.DictReader(fh) if r["kind"] == "eval"}


def test_two_processes_evaluate_what_one_does(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    scaleloop(["train", *ARGS, "--out", str(one)], cwd=tmp_path, timeout=240)
    res = scaleloop(["train", *ARGS, "--nproc", "2", "--strategy", "ddp", "--out", str(two)], cwd=tmp_path,
                    timeout=300)
    assert "a fixed sample of 192 of its 200 samples" in res.stdout
    single, dist = eval_rows(one), eval_rows(two)
    assert sorted(single) == sorted(dist) == [2, 4, 6]
    for step in single:
        for column in ("test_loss", "test_acc", "train_eval_loss"):
            assert float(dist[step][column]) == pytest.approx(float(single[step][column]), rel=1e-6, abs=1e-7), \
                (step, column)
