"""Exact evaluation with 1, 2 and 3 Gloo processes on a 101-sample set (101 = 50+51 = 34+34+33).

Every world size must report exactly the same accuracy and the same loss (to float64 rounding
of the final sum), through ``scaleloop.loop.evaluation.evaluate`` and through a user's own metric
built on ``shard_indices`` + ``gather_tensor``; the script itself checks that the gathered
sample order is ``0..100`` and that ``gather_padded`` undoes DistributedSampler's padding.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from procs import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "eval_exact.py"
WORLDS = (1, 2, 3)


def _launch(world: int, out: Path) -> dict:
    # One process runs as plain python: the path where torch.distributed is never touched.
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    res = run([sys.executable, *launcher, str(SCRIPT), str(out / f"logits{world}.pt")], cwd=out, timeout=120)
    assert res.returncode == 0, f"{world} process(es) failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    report = json.loads(res.stdout.strip().splitlines()[-1])
    report["logits"] = torch.load(out / f"logits{world}.pt", weights_only=True)
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("eval_exact")
    # One after the other: on a small CI machine, side by side is no faster (each process
    # spends most of its time importing torch on the same cores).
    return {w: _launch(w, out) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("path", ["evaluate", "evaluate_loader"])
def test_evaluate_is_exact_for_any_world_size(reports: dict[int, dict], world: int, path: str) -> None:
    one, got = reports[1], reports[world]
    assert got["world"] == world
    assert got[path]["samples"] == 101
    assert got[path]["accuracy"] == one["evaluate"]["accuracy"]
    assert got[path]["loss"] == pytest.approx(one["evaluate"]["loss"], rel=1e-12, abs=0)
    # and the same as computing the metric over all 101 gathered outputs at once
    assert got[path]["accuracy"] == got["gathered"]["accuracy"]
    assert got[path]["loss"] == pytest.approx(got["gathered"]["loss"], rel=1e-12, abs=0)
    assert round(got[path]["accuracy"] * 101, 9).is_integer()


@pytest.mark.parametrize("world", WORLDS)
def test_gathered_user_metric_is_exact(reports: dict[int, dict], world: int) -> None:
    one, got = reports[1], reports[world]
    assert got["logits"].shape == (101, 3)
    torch.testing.assert_close(got["logits"], one["logits"], rtol=1e-12, atol=0)
    assert got["gathered"]["accuracy"] == one["gathered"]["accuracy"] == got["gathered"]["summed_accuracy"]
    for key in ("loss", "summed_loss"):
        assert got["gathered"][key] == pytest.approx(one["gathered"]["loss"], rel=1e-12, abs=0)
