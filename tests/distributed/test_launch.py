"""Launching: a user's own script under torchrun, no_sync during accumulation, and torchrun flags."""
from __future__ import annotations

import re

import json
import sys
from pathlib import Path

import pytest
import torch

from procs import run, scaleloop

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.slow
def test_user_script_under_torchrun_matches_single(tmp_path: Path) -> None:
    one = run([sys.executable, str(ROOT / "examples/00_single.py"), "--out", str(tmp_path / "one.pt")], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = run([*TORCHRUN, str(ROOT / "examples/02_ddp.py"), "--out", str(tmp_path / "two.pt")], cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert "rank 0/2" in two.stdout and "rank 1/2" not in two.stdout  # only rank 0 prints
    a = torch.load(tmp_path / "one.pt", weights_only=True)
    b = torch.load(tmp_path / "two.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


@pytest.mark.parametrize("accumulate", [1, 4])
def test_ddp_all_reduces_only_on_the_last_micro_step(tmp_path: Path, accumulate: int) -> None:
    res = run([*TORCHRUN, str(ROOT / "tests/distributed/scripts/no_sync_probe.py"), str(accumulate)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    calls = report["micro_of_call"]
    steps = 64 // (16 * accumulate)
    assert calls, "the communication hook never ran"
    # Every all-reduce happened on the last micro-step: none on micro-steps under no_sync.
    assert set(calls) == {accumulate - 1}
    assert len(calls) % steps == 0


def test_torchrun_command_shapes() -> None:
    from scaleloop.config import TrainConfig
    from scaleloop.launching.torchrun import torchrun_command

    single_node = torchrun_command(TrainConfig(nproc=4), ["train"], python="py")
    assert single_node[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in single_node and "--standalone" in single_node
    assert single_node[-3:] == ["-m", "scaleloop", "train"]
    static = torchrun_command(TrainConfig(nproc=2, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                          master_port=29400), ["train"], python="py")
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"} <= set(static)
    assert "--standalone" not in static
    elastic = torchrun_command(TrainConfig(nproc=2, nnodes=2, rdzv_endpoint="h:1234", max_restarts=3),
                               ["train"], python="py")
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:1234", "--max-restarts=3"} <= set(elastic)


def test_cli_launch_prints_command_and_one_summary(tmp_path: Path) -> None:
    res = scaleloop(["train", "--data", "random", "--n-samples", "256", "--epochs", "1", "--batch-size", "32",
                     "--nproc", "2", "--no-progress", "--out", str(tmp_path / "run")], cwd=tmp_path)
    assert "torch.distributed.run --nproc-per-node=2" in res.stdout
    assert res.stdout.count("summary") == 1           # rank 1 prints nothing
    assert re.search(r"^  world size +2$", res.stdout, re.M) and "ddp" in res.stdout, res.stdout
    assert (tmp_path / "run" / "model.pt").exists()
