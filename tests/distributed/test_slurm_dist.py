"""srun without torchrun: two tasks with SLURM_* set by hand join one Gloo group and train with DDP;
a shell left with an srun task's variables says what it read, and ends its wait in one line."""
from __future__ import annotations

import re

import json
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from procs import child_env, kill_group, run
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
    # The 1-process reference as a fork of the tests' fork server (procs.run); the srun tasks start fresh.
    single = run([*common, "--out", str(tmp_path / "single")], cwd=tmp_path, timeout=120)
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
    # Each task's first line says what it read; rank 1 prints nothing else (rank 0 prints the run's lines).
    for rank, (out, _) in enumerate(outputs):
        assert out.splitlines()[0] == first_line(job_id, rank, WHOLE_TASK), out
    assert len(outputs[1][0].splitlines()) == 1, outputs[1][0]
    a = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "srun" / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


# What the runs above read (task_env), and what a shell left from an earlier job holds (the case).
WHOLE_TASK = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST")
LEFT_BEHIND = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_NODELIST")
TINY = ["train", "--data", "random", "--n-samples", "64", "--batch-size", "32", "--max-steps", "1", "--no-progress",
        "--no-tensorboard", "--device", "cpu"]


def first_line(job_id: str, rank: int, read: tuple[str, ...], limit: str = "1800") -> str:
    return (f"scaleloop: srun task: rank {rank} of 2 of SLURM job {job_id}, step 0, rendezvous at "
            f"localhost:{port_for_job(job_id)} (read from {', '.join(read)}); waiting up to {limit} s (--timeout) "
            "for the other task")


def left_behind(job_id: str, rank: int) -> dict[str, str]:
    """A shell's environment after an srun step: rank ``rank`` of 2's variables, and no srun."""
    env = {k: v for k, v in child_env().items() if k not in NOT_SLURM and not k.startswith("SLURM_")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_JOB_ID=job_id, SLURM_STEP_ID="0",
               SLURM_NODELIST="localhost", SLURM_LOCALID=str(rank), OMP_NUM_THREADS="1")
    return env


@pytest.mark.parametrize("rank", [1, 0])
def test_a_leftover_srun_task_says_what_it_read_and_gives_up_in_one_line(tmp_path: Path, rank: int) -> None:
    # Rank 1 knocks at rank 0's port, where nothing listens; rank 0 listens, and nobody comes.
    job_id = free_job_id()
    res = run([sys.executable, "-m", "scaleloop", *TINY, "--timeout", "2", "--out", str(tmp_path / "run")],
              cwd=tmp_path, env=left_behind(job_id, rank), timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.splitlines() == [first_line(job_id, rank, LEFT_BEHIND, limit="2")], res.stdout
    waited = (f"rank 0 of SLURM job {job_id}, step 0 did not answer at localhost:{port_for_job(job_id)} in 2 s "
              "(Connection refused; this process is rank 1 of 2)" if rank == 1 else
              f"rank 1 of SLURM job {job_id}, step 0 did not join the rendezvous at localhost:{port_for_job(job_id)} "
              "in 2 s (this process is rank 0 of 2)")
    assert res.stderr.splitlines() == [
        f"scaleloop: error: {waited}: if no srun started this process, its SLURM variables are left from an earlier "
        f"job: run `unset {' '.join(LEFT_BEHIND)}` first, or give --nproc N to start N workers here (under srun, "
        "the missing tasks' own output says why they did not come)"], res.stderr
    assert not (tmp_path / "run").exists()   # nothing was written


def test_sigterm_while_a_leftover_srun_task_waits_is_said(tmp_path: Path) -> None:
    job_id = free_job_id()
    proc = subprocess.Popen([sys.executable, "-m", "scaleloop", *TINY, "--out", str(tmp_path / "run")], cwd=tmp_path,
                            env=left_behind(job_id, 1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        # The first line comes once the signal is answered: SIGTERM then, while it waits.
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no first line in 120 s"
        said = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert said.rstrip("\n") == first_line(job_id, 1, LEFT_BEHIND), said
    assert proc.returncode == 143, (out, err)
    assert out == "" and err.splitlines() == [
        f"scaleloop: stopped by SIGTERM while waiting for the other tasks of SLURM job {job_id}, step 0 at "
        f"localhost:{port_for_job(job_id)} (this process is rank 1 of 2); nothing was trained"], err


def test_nproc_wins_over_a_leftover_srun_task(tmp_path: Path) -> None:
    job_id = free_job_id()
    res = run([sys.executable, "-m", "scaleloop", *TINY, "--nproc", "1", "--out", str(tmp_path / "run")],
              cwd=tmp_path, env=left_behind(job_id, 1), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0] == (
        f"scaleloop: note: ignoring SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_JOB_ID={job_id}, SLURM_STEP_ID=0, "
        f"SLURM_LOCALID=1, SLURM_NODELIST=localhost (an srun task's variables: rank 1 of 2 of SLURM job {job_id}, "
        "step 0; --nproc 1 decides)"), res.stdout
    assert re.search(r"^  world size +1$", res.stdout, re.M), res.stdout
    assert (tmp_path / "run" / "model.pt").is_file()
