"""Resume under torchrun: same world size (bitwise), and 2 -> 1 and 1 -> 2 processes.

The first part of each run stops at ``--max-steps 11``, in the middle of epoch 1 (16 steps per
epoch); the second part resumes it with ``--max-steps none`` and finishes epoch 2. The learning
rate is constant, so stopping by ``--max-steps`` does not change the schedule.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from procs import scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["--data", "random", "--n-samples", "1000", "--model", "simplenet", "--epochs", "2",
          "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.05", "--no-progress", "--no-tensorboard",
          "--checkpoint-every", "4", "--log-every", "1"]
STOP = ["--max-steps", "11"]
DDP2 = ["--nproc", "2", "--strategy", "ddp"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    scale = max(t.abs().max().item() for t in a.values())
    return max((a[k] - b[k]).abs().max().item() / scale for k in a)


def step_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def uninterrupted(root: Path) -> dict[str, Path]:
    runs = {"1": root / "whole1", "2": root / "whole2"}
    scaleloop(["train", *COMMON, "--out", str(runs["1"])], cwd=root)
    scaleloop(["train", *COMMON, *DDP2, "--out", str(runs["2"])], cwd=root)
    return runs


def interrupted_then_resumed(root: Path, name: str, first: list[str], second: list[str]) -> tuple[Path, str]:
    out = root / name
    scaleloop(["train", *COMMON, *first, *STOP, "--out", str(out)], cwd=root)
    assert (out / "checkpoints" / "step-00000011").is_dir()
    # Only --out and what changes: the rest comes from the run's saved config.toml.
    res = scaleloop(["train", "--out", str(out), "--max-steps", "none", *second], cwd=root)
    return out, res.stdout


def test_resume_same_world_size_is_bitwise(root: Path, uninterrupted: dict[str, Path]) -> None:
    out, log = interrupted_then_resumed(root, "ddp2-ddp2", DDP2, [])
    assert "resuming from" in log and "step 11 of 16" in log
    whole, resumed = weights(uninterrupted["2"]), weights(out)
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), f"{key} differs after resume"
    # The metrics pick up where the checkpoint left off: every step once, same losses.
    rows, ref = step_rows(out), step_rows(uninterrupted["2"])
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    assert [r["samples"] for r in rows] == [r["samples"] for r in ref]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in ref]


def test_resume_two_processes_on_one(root: Path, uninterrupted: dict[str, Path]) -> None:
    out, log = interrupted_then_resumed(root, "ddp2-single", DDP2, ["--nproc", "1"])
    assert "written by 2 process(es), this run has 1" in log
    assert max_rel_diff(weights(uninterrupted["1"]), weights(out)) <= 1e-5
    assert [r["samples"] for r in step_rows(out)] == [r["samples"] for r in step_rows(uninterrupted["1"])]


def test_resume_one_process_on_two(root: Path, uninterrupted: dict[str, Path]) -> None:
    out, log = interrupted_then_resumed(root, "single-ddp2", [], DDP2)
    assert "written by 1 process(es), this run has 2" in log
    assert max_rel_diff(weights(uninterrupted["1"]), weights(out)) <= 1e-5
    assert max_rel_diff(weights(uninterrupted["2"]), weights(out)) <= 1e-5
