"""srun without torchrun: two tasks with SLURM_* set by hand join one Gloo group and train with DDP."""
from __future__ import annotations

import re

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from procs import child_env, kill_group
from scaleloop.runtime.slurm import PORT_BASE, PORT_SPAN, port_for_job

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "slurm_worker.py"
# Launchers' variables that must not leak in from the environment running the tests.
NOT_SLURM = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def free_job_id() -> str:
    """A job id whose derived port is free now (other tests, or another run, may hold one)."""
    for offset in range(PORT_SPAN):
        port = PORT_BASE + (offset * 7919) % PORT_SPAN   # spread the tries over the range
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        job_id = str(900_000 + port - PORT_BASE)
        assert port_for_job(job_id) == port
        return job_id
    pytest.skip("no free port in the SLURM-derived range")


def task_env(job_id: str, rank: int) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if k not in NOT_SLURM and not k.startswith("SLURM_")}
    env.update({
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2",
        # The first host is rank 0's node; the rest of this list never gets contacted.
        "SLURM_JOB_NODELIST": "localhost,node[02-03]", "OMP_NUM_THREADS": "1",
    })
    return env


def test_two_srun_tasks_form_a_group_and_train_alike(tmp_path: Path) -> None:
    job_id = free_job_id()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT)], cwd=tmp_path, env=task_env(job_id, rank),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, f"task failed ({proc.returncode}):\n{out}\n{err}"
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    for rank, report in enumerate(reports):
        assert (report["rank"], report["world_size"], report["local_rank"], report["local_world_size"]) == (rank, 2, rank, 2)
        assert report["master"] == ["localhost", port_for_job(job_id)]
        assert report["all_reduce"] == 3.0      # 1 + 2: both tasks are in one group
        assert report["changed"] > 0
    # DDP kept the replicas equal through the steps.
    torch.testing.assert_close(torch.tensor(reports[0]["params"]), torch.tensor(reports[1]["params"]))


def test_scaleloop_train_as_two_srun_tasks_matches_one_process(tmp_path: Path) -> None:
    # `srun scaleloop train ...`: each task is a worker (no torchrun), ranks from SLURM_*.
    common = [sys.executable, "-m", "scaleloop", "train", "--data", "random", "--n-samples", "512",
              "--epochs", "1", "--max-steps", "5", "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.1",
              "--no-progress", "--no-tensorboard", "--device", "cpu"]
    single = subprocess.run([*common, "--out", str(tmp_path / "single")], cwd=tmp_path, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    job_id = free_job_id()
    procs = [subprocess.Popen([*common, "--strategy", "ddp", "--out", str(tmp_path / "srun")], cwd=tmp_path,
                              env=task_env(job_id, rank), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, f"task failed ({proc.returncode}):\n{out}\n{err}"
    assert re.search(r"^  world size +2$", outputs[0][0], re.M), outputs[0][0]
    assert outputs[1][0] == ""            # only rank 0 prints
    a = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "srun" / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
