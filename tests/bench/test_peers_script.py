"""benchmarks/peers/run.py, the comparison with Accelerate and Fabric, in a smoke-sized run.

Accelerate and Lightning are not dependencies of scaleloop: where they are missing (the
project's own environment), their rows must say so instead of failing the benchmark. No
timing is asserted, only that every row measured the same work and the report is complete.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "peers" / "run.py"
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from procs import child_env, run  # noqa: E402


def env() -> dict[str, str]:
    """The script's environment; each run of it is a fork of the tests' fork server (procs.run), as
    the suite's other runs are."""
    return child_env({"PYTHONPATH": str(ROOT / "src")})


def test_peers_quick(tmp_path: Path) -> None:
    res = run([sys.executable, str(SCRIPT), "--quick", "--workloads", "tutorial", "--steps", "3",
               "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)], cwd=tmp_path, env=env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    [path] = tmp_path.glob("*_peers-quick.json")
    data = json.loads(path.read_text())
    md = path.with_suffix(".md").read_text()
    assert data["what"] == "peers" and data["quick"]
    [result] = data["data"]["results"]
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ["raw", "raw-gather", "scaleloop", "accelerate", "fabric"]
    assert rows["raw"]["ratio"] == pytest.approx(1.0)
    for key, row in rows.items():
        if "note" in row:                        # a peer that is not installed here
            assert key in ("accelerate", "fabric") and "not installed" in row["note"]
            continue
        assert row["median"] > 0 and row["min"] <= row["median"] <= row["max"]
        assert row["samples_per_run"] == 3 * 128                       # the same steps and batch for all
        assert row["threads"] == [1]
        assert row["ratio"] == pytest.approx(row["median"] / rows["raw"]["median"])
        assert 0 < row["cpu_ms_min"] <= row["cpu_ms_per_step"] <= row["cpu_ms_max"]
        assert row["cpu_ratio"] == pytest.approx(rows["raw"]["cpu_ms_per_step"] / row["cpu_ms_per_step"])
    assert data["hardware"]["cpu"] and data["hardware"]["cores"] >= 1
    assert data["data"]["load_average_start"] is None or len(data["data"]["load_average_start"]) == 3
    assert "median / raw" in md and "CPU ms / step" in md and "Load average" in md
    assert "scaleloop is " in md                                      # the verdict, whatever it is

    # --render rebuilds the report from the saved measurements, measuring nothing.
    again = tmp_path / "again"
    res = run([sys.executable, str(SCRIPT), "--render", str(path), "--out", str(again)], cwd=tmp_path, env=env(),
              timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rendered = json.loads((again / path.name).read_text())
    assert rendered["data"] == data["data"] and rendered["command"] == data["command"]


def test_peers_rejects_unknown_names(tmp_path: Path) -> None:
    res = run([sys.executable, str(SCRIPT), "--frameworks", "raw,keras", "--out", str(tmp_path)], cwd=tmp_path,
              env=env(), timeout=120)
    assert res.returncode == 2 and "keras" in res.stderr
