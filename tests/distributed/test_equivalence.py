"""N processes with global batch B train the same model as 1 process with batch B.

Every run here is the real thing: ``scaleloop train --nproc 2`` starts two Gloo workers under
torchrun. The final weights (model.pt) are compared with a single-process run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from procs import scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = ["--epochs", "1", "--max-steps", "6", "--no-progress", "--no-tensorboard", "--optimizer", "sgd",
         "--lr", "0.1", "--batch-size", "64"]
MLP = ["--data", "random", "--n-samples", "1000", "--model", "simplenet", *STEPS]
CONV = ["--data", "digits", "--model", "convnet", *STEPS]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest |a-b| over all float tensors, relative to the largest weight magnitude."""
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values() if t.is_floating_point())
    return max(((a[k] - b[k]).abs().max().item() / scale, k) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("equiv")
    cache: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in cache:
            out = root / f"run{len(cache)}"
            scaleloop(["train", *args, "--out", str(out)], cwd=root)
            cache[args] = out
        return cache[args]

    return get


@pytest.mark.parametrize("strategy", ["ddp", "allreduce"])
@pytest.mark.parametrize("accumulate", ["1", "2"])
def test_two_processes_equal_one(runs, strategy: str, accumulate: str) -> None:
    single = weights(runs(*MLP))
    dist = weights(runs(*MLP, "--nproc", "2", "--strategy", strategy, "--accumulate", accumulate))
    diff, name = max_rel_diff(single, dist)
    assert diff <= 1e-5, f"{strategy} x2 (accumulate {accumulate}) differs from 1 process at {name}: {diff:.2e}"


def test_uneven_last_step_is_still_exact(runs) -> None:
    # 1000 samples, batch 64: the epoch ends with a 40-sample step split 20/20 (and 10s with
    # accumulation); the per-micro-batch loss weights keep the update exact.
    args = [a if a != "6" else "100" for a in MLP]
    single = weights(runs(*args))
    dist = weights(runs(*args, "--nproc", "2", "--strategy", "ddp", "--accumulate", "2"))
    diff, name = max_rel_diff(single, dist)
    assert diff <= 1e-5, f"full epoch with an uneven last step differs at {name}: {diff:.2e}"


def test_batchnorm_differs_without_sync_and_matches_with_it(runs) -> None:
    single = weights(runs(*CONV))
    plain, _ = max_rel_diff(single, weights(runs(*CONV, "--nproc", "2", "--strategy", "ddp")))
    # Each rank normalises with the statistics of its own 32 samples, not of all 64.
    assert plain > 1e-3, f"plain BatchNorm unexpectedly matched ({plain:.2e}): the test would not catch a sync bug"
    for strategy in ("ddp", "allreduce"):
        synced, name = max_rel_diff(single, weights(runs(*CONV, "--nproc", "2", "--strategy", strategy, "--sync-batchnorm")))
        assert synced <= 1e-5, f"{strategy} --sync-batchnorm differs at {name}: {synced:.2e}"


def test_sync_batchnorm_with_accumulation_matches_same_accumulation(runs) -> None:
    # BatchNorm sees micro-batches, so the reference accumulates too; micro-step k covers the
    # same samples for any world size.
    single = weights(runs(*CONV, "--accumulate", "2"))
    dist = weights(runs(*CONV, "--accumulate", "2", "--nproc", "2", "--strategy", "ddp", "--sync-batchnorm"))
    diff, name = max_rel_diff(single, dist)
    assert diff <= 1e-5, f"ddp --sync-batchnorm --accumulate 2 differs at {name}: {diff:.2e}"


def test_rank_zero_alone_reports_global_numbers(runs) -> None:
    single_dir = runs(*MLP)
    dist_dir = runs(*MLP, "--nproc", "2", "--strategy", "ddp", "--accumulate", "1")
    import csv

    def epoch_row(d: Path) -> dict[str, str]:
        # --max-steps ends these runs mid-epoch, so the one summary row is a "stop" row.
        rows = [r for r in csv.DictReader(open(d / "metrics.csv")) if r["kind"] in ("epoch", "stop")]
        assert len(rows) == 1 and rows[0]["kind"] == "stop"
        return rows[0]

    one, two = epoch_row(single_dir), epoch_row(dist_dir)
    # The loss reported by rank 0 is reduced over both ranks: it equals the 1-process loss.
    assert abs(float(one["train_loss"]) - float(two["train_loss"])) < 1e-5
    assert one["test_acc"] == two["test_acc"] and one["samples"] == two["samples"]
