"""``scaleloop train --profile 2`` on 2 real Gloo processes under ddp, fsdp, pipeline and ``--mesh dp=2``.

Each run is started as a user starts it (``python -m scaleloop train --nproc 2 ...``); each must
write one trace per rank (Chrome JSON holding its steps and the process group's collectives), a
summary with both ranks whose parts add up to the step time and that names the slowest rank,
communication under every strategy (ddp's all-reduce, fsdp's all-gather and reduce-scatter, the
pipeline's send and receive), and the timeline picture.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import child_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["--data", "random", "--n-samples", "512", "--batch-size", "64", "--max-steps", "4", "--nproc", "2",
          "--no-progress", "--no-tensorboard", "--no-checkpoints", "--device", "cpu", "--profile", "2"]
LAYOUTS = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"], "pipeline": ["--strategy", "pipeline"],
           "mesh": ["--mesh", "dp=2"]}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each layout's run directory and what it printed (one 2-process run each, one after another)."""
    root = tmp_path_factory.mktemp("profile-dist")
    out = {}
    for name, flags in LAYOUTS.items():
        res = run([sys.executable, "-m", "scaleloop", "train", *COMMON, *flags, "--out", str(root / name)],
                  cwd=root, timeout=180, env=child_env({"OMP_NUM_THREADS": "1"}))
        assert res.returncode == 0, f"{name} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
        out[name] = (root / name, res.stdout)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_trace_per_rank_with_its_steps_and_collectives(profiled, layout: str) -> None:
    run_dir, _ = profiled[layout]
    for rank in (0, 1):
        events = json.loads((run_dir / "profile" / f"rank-{rank}.pt.trace.json").read_text())["traceEvents"]
        names = [e["name"] for e in events if e.get("ph") == "X"]
        assert names.count("scaleloop.step") == 2, (layout, rank)
        assert any(n.startswith(("gloo:", "c10d::")) for n in names), (layout, rank)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_summary_holds_both_ranks_their_parts_and_the_slowest(profiled, layout: str) -> None:
    run_dir, printed = profiled[layout]
    summary = json.loads((run_dir / "profile" / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    for rank in summary["ranks"]:
        assert rank["steps"] == 2
        assert sum(rank["parts_ms"].values()) == pytest.approx(rank["step_ms"], rel=1e-6)
        assert 0 < rank["comm_ms"] and rank["parts_ms"]["comm exposed"] <= rank["comm_ms"] + 1e-9
        assert rank["comm_overlapped_ms"] <= rank["comm_ms"] + 1e-9
        assert rank["parts_ms"]["forward"] > 0 and rank["parts_ms"]["optimizer"] > 0
    assert summary["slowest"]["rank"] in (0, 1) and summary["slowest"]["text"]
    assert "profile: 2 step(s) (steps 3-4) on 2 rank(s)" in printed and "slowest: " in printed
    assert (run_dir / "profile" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
