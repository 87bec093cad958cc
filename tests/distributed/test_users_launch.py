"""Every strategy and the launching commands, started as users start them: every process a fresh
interpreter (``procs.run(..., fresh=True)``).

The rest of the suite starts ``scaleloop train --nproc N``'s torchrun agent and workers as forks
of a process that has imported torch (``forked_launch.py``: a fresh worker costs about 3.5
CPU-seconds of start-up). Here the same commands run both ways: the fresh run must end with the
forked run's weights, bit for bit, so what the forked runs show holds for the users' path.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from procs import run, scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = ["--data", "random", "--n-samples", "512", "--hidden-dim", "16", "--batch-size", "32", "--max-steps", "4",
         "--checkpoint-every", "2", "--no-progress", "--no-tensorboard"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize("strategy", [["--strategy", "ddp"], ["--strategy", "allreduce"], ["--strategy", "fsdp"],
                                      ["--strategy", "pipeline"], ["--mesh", "fsdp=2"]], ids=lambda s: s[-1])
def test_a_fresh_launch_trains_what_the_forked_one_does(tmp_path: Path, strategy: list[str]) -> None:
    args = ["train", "--nproc", "2", *STEPS, *strategy]
    fresh = scaleloop([*args, "--out", str(tmp_path / "fresh")], cwd=tmp_path, fresh=True)
    scaleloop([*args, "--out", str(tmp_path / "forked")], cwd=tmp_path)
    assert fresh.stdout.startswith("scaleloop: launching 2 process(es) x 1 node(s) with torchrun:"), fresh.stdout
    got, expected = weights(tmp_path / "fresh"), weights(tmp_path / "forked")
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs between the fresh and the forked launch"
    for rank in (0, 1):
        assert (tmp_path / "fresh" / "logs" / f"rank-{rank}.log").read_text().startswith("==== scaleloop worker rank")


def test_verify_started_fresh_passes(tmp_path: Path) -> None:
    res = run([sys.executable, "-m", "scaleloop", "verify", "--nproc", "2", "--data", "random", "--hidden-dim", "16",
               "--batch-size", "32", "--steps", "2", "--n-samples", "256", "--device", "cpu"], cwd=tmp_path,
              timeout=240, fresh=True)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "verdict: PASS - 2 processes (ddp) train the same model as 1 process over 2 step(s)" in res.stdout


def test_bench_started_fresh_measures_two_workers(tmp_path: Path) -> None:
    res = run([sys.executable, "-m", "scaleloop", "bench", "scaling", "--workers", "1,2", "--quick", "--device", "cpu",
               "--out", str(tmp_path)], cwd=tmp_path, timeout=240, fresh=True)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    [result] = tmp_path.glob("*_scaling-quick.json")
    assert '"workers": 2' in result.read_text()
