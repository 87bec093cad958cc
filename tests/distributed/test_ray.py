"""Ray Train as a home (``scaleloop.ray``), on a real local Ray cluster: the CLI form, a child
process, the library form and its restart, under ddp and fsdp, each bitwise equal to torchrun's
``--nproc 2``.

One cluster and one Ray job serve the whole file: ``ray_jobs.py`` starts the cluster, runs the
job (what it covers: its docstring) and shuts the cluster down; the tests read what it left. Ray is a dev extra: a
missing ``ray`` fails here, it is not skipped.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import ray  # noqa: F401 - the dev extra this file tests; missing, the file fails
import torch

from procs import run, scaleloop
from ray_jobs import SETTINGS, flags

from scaleloop.ray import in_ray_train_worker, metrics_of, started_by_ray_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Ray job's and the torchrun runs' directories, made once for the file (every process
    they started is ended by ``procs.run``: Ray's own carry the test's mark too)."""
    root = tmp_path_factory.mktemp("ray")
    # The driver is a fork of the tests' fork server (torch imported); Ray starts its processes fresh.
    res = run([sys.executable, str(HERE / "ray_jobs.py"), str(root)], cwd=root, timeout=900, merge=True)
    assert res.returncode == 0, res.stdout[-6000:]
    (root / "driver-console.txt").write_text(res.stdout)   # what the job's user sees (Ray forwards the workers')
    for strategy in ("ddp", "fsdp"):
        scaleloop(["train", "--nproc", "2", *flags(strategy), "--out", str(root / f"torchrun-{strategy}")], cwd=root)
    return root


def job(work: Path) -> dict[str, Any]:
    return json.loads((work / "job.json").read_text())


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bitwise(run_dir: Path, reference: Path) -> None:
    got, expected = weights(run_dir), weights(reference)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{run_dir.name}: {name} differs from {reference.name}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_cli_in_a_ray_worker_trains_torchruns_weights_reports_to_ray_and_logs_each_rank(
        work: Path, strategy: str) -> None:
    run_dir = work / f"cli-{strategy}"
    assert_bitwise(run_dir, work / f"torchrun-{strategy}")
    rank0, rank1 = ((run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1))
    assert rank0.startswith("scaleloop: in a Ray Train worker: rank 0 of 2, in Ray's process group (gloo)")
    assert rank0.count("epoch 1: train loss") == 1   # each line once, though Ray's print logs it too
    # What a torchrun rank 0's log holds: the summary too; and what handing checkpoints to Ray cost.
    assert "\nsummary\n" in rank0 and f"  run directory    {run_dir}" in rank0, rank0[-2000:]
    handed = re.search(r"^ray: (\d+) of (\d+) checkpoint\(s\) handed to Ray in [\d.]+ s \(writing them took", rank0, re.M)
    assert handed and 2 <= int(handed[1]) <= int(handed[2]), rank0[-2000:]   # the first and the last at least
    assert "from rank 1" in rank1   # Ray's own lines for rank 1 (scaleloop's other ranks print nothing)
    assert "started by a Ray Train worker" not in rank0 and job(work)["error"] is None


def test_each_scaleloop_line_reaches_the_jobs_console_once(work: Path) -> None:
    # Ray Train's print in a worker both logs a line and prints it again unless sys.stdout is the
    # process's own (scaleloop.ray.printed_once): every line came twice, one after the other.
    said: dict[str, list[str]] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", (work / "driver-console.txt").read_text()).splitlines():
        where, _, text = line.partition(") ")
        if where.startswith("(RayTrainWorker pid=") and text.startswith("scaleloop: "):
            said.setdefault(where, []).append(text)
    lines = [text for texts in said.values() for text in texts]
    assert sum("on cpu (1 threads), fp32" in text for text in lines) >= 4, lines   # each run's first line, seen
    for where, texts in said.items():
        twice = [a for a, b in zip(texts, texts[1:]) if a == b]
        assert not twice and not any("[repeated" in t for t in texts), (where, twice or texts)


def test_a_child_process_of_a_ray_worker_trains_beside_rays_group(work: Path) -> None:
    """Started by each worker, ``scaleloop train`` meets in Ray's store, not on Ray's port."""
    assert_bitwise(work / "child-ddp", work / "torchrun-ddp")


def test_a_restarted_ray_job_continues_from_rays_checkpoint_bitwise(work: Path) -> None:
    run_dir = work / "lib-ddp"
    # The first attempt stopped in step 5 after its checkpoint of step 3; the restart removed its directory.
    assert "'step-00000003'" in (first := (work / "first-attempt.txt").read_text()) and "step-00000006" not in first
    assert Path((run_dir / "resumed_from.txt").read_text()) == run_dir / "checkpoints" / "step-00000003"
    assert "scaleloop: continuing from Ray's checkpoint " in (run_dir / "logs" / "rank-0.log").read_text()
    assert_bitwise(run_dir, work / "torchrun-ddp")
    # Ray's result: the last checkpoint (the library run's step 8), with its metrics.
    assert job(work)["metrics"]["step"] == 8 and job(work)["metrics"]["samples"] == SETTINGS["n_samples"]
    assert Path(job(work)["checkpoint"], "state.pt").is_file()


def test_the_library_under_fsdp_equals_torchrun(work: Path) -> None:
    assert_bitwise(work / "lib-fsdp", work / "torchrun-fsdp")
    # Ray's latest checkpoint was the CLI run's, earlier in the job: another --out, not resumed.
    assert (work / "lib-fsdp" / "resumed_from.txt").read_text() == "None"
    assert "is another run's (--out " in (work / "lib-fsdp" / "logs" / "rank-0.log").read_text()


RAY_WORKER_ENV = {"RAY_RAYLET_PID": "7", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}


def test_where_a_process_runs_is_read_from_rays_variables_and_this_process() -> None:
    assert in_ray_train_worker(RAY_WORKER_ENV, {"ray.train": object()})
    assert not started_by_ray_worker(RAY_WORKER_ENV, {"ray.train": object()})
    assert started_by_ray_worker(RAY_WORKER_ENV, {})   # a child process: Ray's variables, not Ray
    torchrun = {k: v for k, v in RAY_WORKER_ENV.items() if k != "RAY_RAYLET_PID"}
    assert not in_ray_train_worker(torchrun, {"ray.train": object()}) and not started_by_ray_worker(torchrun, {})
    under_torchrun = {**RAY_WORKER_ENV, "TORCHELASTIC_RUN_ID": "x"}   # torchrun started by a Ray worker
    assert not started_by_ray_worker(under_torchrun, {})


def test_metrics_for_ray_leave_out_what_is_not_known_yet() -> None:
    from scaleloop.loop.result import RunResult

    assert metrics_of(RunResult(steps=3, epochs=0, samples=192)) == {"step": 3, "epoch": 0, "samples": 192}
