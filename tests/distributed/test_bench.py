"""``scaleloop bench scaling|strategies --quick``: real worker processes under torchrun.

These check the outputs' structure and sanity (positive throughput, efficiency in (0, 1.2],
bytes that match the model, a complete projection), never how fast this machine is.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from scaleloop.bench import costmodel

from procs import run

pytestmark = pytest.mark.distributed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(tmp_path: Path, *argv: str) -> tuple[dict[str, Any], str, str]:
    """Run ``python -m scaleloop.bench <argv> --quick`` on the CPU (2 workers need 2 GPUs on CUDA); the
    JSON, the markdown and stderr."""
    res = run([sys.executable, "-m", "scaleloop.bench", *argv, "--quick", "--device", "cpu", "--out", str(tmp_path)],
              cwd=tmp_path, timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    [json_path] = tmp_path.glob(f"*_{argv[0]}-quick.json")
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text(), res.stderr


def biggernet_grad_bytes(image_size: int, hidden: int, classes: int = 10) -> int:
    features = 3 * image_size * image_size
    params = features * hidden + hidden + hidden * hidden + hidden + hidden * classes + classes
    return 4 * params


@pytest.fixture(scope="module")
def scaling(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    return bench(tmp_path_factory.mktemp("scaling"), "scaling", "--workers", "1,2")


def test_scaling_table_is_sane(scaling: tuple[dict[str, Any], str, str]) -> None:
    data, md, err = scaling
    points = data["data"]["points"]
    assert [p["workers"] for p in points] == [1, 2]
    quick = {"image_size": 8, "hidden_dim": 128, "batch_size": 16}   # the --quick preset
    for p in points:
        assert p["per_worker_batch"] == quick["batch_size"]                  # weak scaling by default
        assert p["global_batch"] == p["workers"] * quick["batch_size"]
        assert p["samples_per_s"] > 0 and p["loss_finite"]
        assert p["efficiency"] > 0   # its value is a timing (1.36 once on a loaded machine): checked below against the rates
        assert 0 < p["mfu"] < 1
        b = p["breakdown"]
        assert all(b[k] >= 0 for k in ("data_s", "forward_s", "backward_s", "optimizer_s"))
        assert b["data_s"] + b["forward_s"] + b["backward_s"] + b["optimizer_s"] == pytest.approx(b["step_s"], rel=1e-6)
    assert points[0]["efficiency"] == pytest.approx(1.0)
    assert points[1]["efficiency"] == pytest.approx(points[1]["samples_per_s"] / (2 * points[0]["samples_per_s"]))
    # Communication: DDP hands every gradient byte to its all-reduce once per step.
    two = points[1]
    expected = biggernet_grad_bytes(quick["image_size"], quick["hidden_dim"])
    assert two["comm"]["grad_bytes"] == expected
    assert two["comm"]["reduced_bytes_per_step"] == expected
    assert two["comm"]["buckets_per_step"] >= 1
    assert 0 < two["comm"]["in_flight_s"] <= two["breakdown"]["step_s"]
    # Timed, so only their presence is checked, not which of the two was faster.
    assert two["allreduce_bench"]["grad_s"] > 0 and two["allreduce_bench"]["small_s"] > 0
    assert points[0]["comm"]["reduced_bytes_per_step"] is None and points[0]["allreduce_bench"] is None
    assert "2 worker(s)" in err                                     # progress was shown
    for header in ("| workers | per-worker batch | global batch | samples/s |", "data wait", "MODEL CHECK"):
        assert header in md


def test_scaling_breakdown_says_why(scaling: tuple[dict[str, Any], str, str]) -> None:
    """Backward split at the last all-reduce launch; the lost efficiency attributed to causes."""
    data, md, _ = scaling
    one, two = data["data"]["points"]
    for p in (one, two):
        assert p["threads_seen"] == [1]                                   # one torch thread per worker
        b = p["breakdown"]
        parts = b["backward_compute_s"] + b["wait_s"] + b["comm_exposed_s"]
        assert parts == pytest.approx(b["backward_s"], rel=1e-6)
        assert min(b["backward_compute_s"], b["wait_s"], b["comm_exposed_s"]) >= 0
    assert one["breakdown"]["comm_exposed_s"] == 0 and one["breakdown"]["wait_s"] == 0
    for p in (one, two):   # the training thread's CPU time of its compute, at most its wall time (+ clock grain)
        b = p["breakdown"]
        assert 0 < b["compute_cpu_s"] <= b["forward_s"] + b["backward_compute_s"] + b["optimizer_s"] + 0.01
    assert len(two["repetitions"]) == 1 and two["efficiency_min"] == pytest.approx(two["efficiency"])
    [a] = data["data"]["attribution"]
    assert a["workers"] == 2 and a["backward_split"] and a["compute_off_core_s"] is not None
    assert sum(a["points"].values()) == pytest.approx(1 - a["efficiency"])
    assert a["efficiency"] == pytest.approx(two["efficiency"])   # the same timings, as step times
    assert "Why not N x one worker" in md and "of which all-reduce not hidden" in md
    assert any(n.startswith("Target scaling efficiency 0.90 at 2 workers") for n in data["notes"])


def test_scaling_projection_and_model_check(scaling: tuple[dict[str, Any], str, str]) -> None:
    data, md, _ = scaling
    model = data["data"]["model"]
    projection = model["projection"]
    assert {r["workers"] for r in projection} == {8, 16, 32, 64, 128, 256, 512, 1024}
    assert {r["interconnect"] for r in projection} == {"nvlink", "ib-ndr", "100gbe", "25gbe"}
    for r in projection:
        assert 0 < r["efficiency_no_overlap"] <= r["efficiency_overlap"] <= 1.0
    # The bandwidth is None (JSON for infinite) when timing noise left nothing to fit it to.
    bandwidth = model["fabric"]["bandwidth_Bps"]
    assert (bandwidth is None or bandwidth > 0) and model["fabric"]["latency_s"] > 0
    [check] = model["check"]
    assert check["workers"] == 2
    assert check["error_points_no_overlap"] == pytest.approx(
        check["predicted_efficiency_no_overlap"] - check["measured_efficiency"])
    assert "MODEL: projected weak-scaling efficiency" in md and "not a measurement" in md
    # On a CPU the GPU's compute time is estimated from FLOPs and says so wherever it is shown;
    # the measured CPU step is not the projection's compute.
    assert model["compute_source"].startswith("ESTIMATED, not measured: ")
    # The estimate's shape, which no measured step has: no data time, a backward of exactly two
    # forwards, at least the launch floor. (Not "far from the CPU step": the two can be close.)
    compute = model["compute"]
    assert compute["data_s"] == 0.0 and compute["backward_s"] == pytest.approx(2 * compute["forward_s"])
    assert model["compute_s"] >= costmodel.MIN_GPU_STEP_S - 1e-12
    assert md.count("ESTIMATED, not measured") >= 3   # both projection tables and the inputs note
    assert "nothing about GPUs here is measured" in md
    assert "against a published scaling table" in md and len(model["published_check"]) == 6


def test_strategies_table_runs_every_mesh_composition_on_four_workers(tmp_path: Path) -> None:
    from scaleloop.strategies.tensor import strided_tp_supported

    # TinyGPT has a tp_plan() and as_sequential(): every row runs, the pipeline's too, whose stages
    # hold gradients of different sizes (the all-reduce benchmark takes the largest) and compute
    # the loss on the last stage only.
    # 2 timed steps after 1 warm-up, not --quick's 6 after 2: each row's checks below hold for any
    # step (ten rows of 4 workers: 28 CPU-seconds at 6 + 2 steps, 15 at 2 + 1).
    data, _, _ = bench(tmp_path, "strategies", "--workers", "4", "--model", "tinygpt", "--data", "tokens",
                       "--steps", "2", "--warmup", "1")
    rows = {r["label"]: r for r in data["data"]["rows"]}
    ran = [label for label, r in rows.items() if r["status"] == "ran"]
    tp_rows = ["tp x 4 (mesh tp=4)", "fsdp x tp (mesh fsdp=2,tp=2)", "dp x tp (mesh dp=2,tp=2)"]
    if not strided_tp_supported():   # torch 2.11: TinyGPT's tp rows say they need torch 2.13
        assert all("needs torch 2.13" in rows[label]["status"] for label in tp_rows), rows
        tp_rows = []
    assert ran == ["single (1 thread)", "single (4 threads)", "ddp x 4", "allreduce x 4", "fsdp x 4",
                   *tp_rows[:2], "hsdp (mesh dp=2,fsdp=2)", *tp_rows[2:], "pp x dp (mesh pp=2,dp=2)"], rows
    pipeline = rows["pp x dp (mesh pp=2,dp=2)"]
    assert pipeline["per_worker_batch"] == 16 and pipeline["loss"] > 0
    assert 0 < pipeline["backward_s"] < pipeline["step_s"]


def test_strategies_table(tmp_path: Path) -> None:
    data, md, _ = bench(tmp_path, "strategies", "--workers", "2")
    rows = {r["label"]: r for r in data["data"]["rows"]}
    assert list(rows) == ["single (1 thread)", "single (2 threads)", "dp", "ddp x 2", "allreduce x 2", "fsdp x 2",
                          "tp x 2 (mesh tp=2)", "fsdp x tp", "hsdp", "dp x tp", "pp x dp"]
    assert "needs CUDA" in rows["dp"]["status"]
    # The --mesh rows: BiggerNet has no tp_plan(), and 2-D meshes need 4 workers; each says so.
    assert "BiggerNet has no tp_plan()" in rows["tp x 2 (mesh tp=2)"]["status"]
    assert all(rows[k]["status"] == "needs an even --workers of 4 or more" for k in ("fsdp x tp", "hsdp", "dp x tp", "pp x dp"))
    ran = ["single (1 thread)", "single (2 threads)", "ddp x 2", "allreduce x 2", "fsdp x 2"]
    assert rows["fsdp x 2"]["grad_bytes"] is None        # FSDP's collectives are not timed
    for label in ran:
        row = rows[label]
        assert row["status"] == "ran" and row["samples_per_s"] > 0 and row["global_batch"] == 32
    assert rows["ddp x 2"]["per_worker_batch"] == 16
    assert rows["ddp x 2"]["grad_bytes"] == rows["allreduce x 2"]["grad_bytes"] == biggernet_grad_bytes(8, 128)
    assert rows["single (1 thread)"]["speedup"] == pytest.approx(1.0)
    assert "| strategy | processes |" in md
