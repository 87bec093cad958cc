"""``scaleloop train`` in the job that started it (scaleloop.launching.jobs), as a user starts it:
leftover launcher variables and a pod's contradicting flags are one line before anything waits,
and a Kubeflow pod's variables become the torchrun command of one machine of the job.

The runs stop where torchrun would start (the probe below), so no process group is made here;
tests/distributed/test_kubernetes.py trains through pods of both APIs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# `scaleloop train ARGV` up to the start of torchrun, replaced by what the launcher would run:
# torchrun's command, whether torch was imported, and the Kubeflow variables torchrun would see.
PROBE = """
import sys
import scaleloop.launching.launcher as launcher

def supervise(launch, forward=()):
    print("torch imported" if "torch" in sys.modules else "no torch")
    print(" ".join(launch.supervised_command()))
    print("passed on:", sorted(k for k in launch.env if k.startswith("PET_") and k != "PET_SIGNALS_TO_HANDLE"))
    sys.exit(0)

launcher.supervise = supervise
from scaleloop.cli import main
sys.exit(main(sys.argv[1:]))
"""

LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_JOB_ID")
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def train(tmp_path: Path, env: dict[str, str], *argv: str, probe: bool = False) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHERS and not k.startswith("PET_")}
    command = [sys.executable, "-c", PROBE] if probe else [sys.executable, "-m", "scaleloop"]
    return subprocess.run([*command, "train", *argv, "--out", str(tmp_path / "run")],
                          env={**base, "PYTHONPATH": str(SRC), **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env,names", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1, WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"},
     "RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT=29517"),
])
def test_leftover_variables_are_one_line_and_no_wait(tmp_path: Path, env: dict[str, str], names: str) -> None:
    started = time.monotonic()
    done = train(tmp_path, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"scaleloop: error: {names} are set, but no torchrun, srun or Kubeflow job started this process (left from "
        f"an earlier job or a notebook?): run `unset {' '.join(n.split('=')[0] for n in names.split(', '))}` first, "
        "or give --nproc N to start N workers here"], done.stderr
    assert not (tmp_path / "run").exists()
    assert time.monotonic() - started < 60   # before: 200 s of silence, or a 29-line traceback


V1_POD = dict(POD, WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="23456", PET_MASTER_ADDR="127.0.0.1",
              PET_MASTER_PORT="23456", PET_NPROC_PER_NODE="1", PET_NODE_RANK="1", PET_NNODES="2")


def test_a_pods_flag_that_contradicts_its_job_is_one_line(tmp_path: Path) -> None:
    done = train(tmp_path, V1_POD, "--nproc", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "scaleloop: error: --nproc 2 contradicts this pod's PyTorchJob (PET_NPROC_PER_NODE=1): drop the flag (the "
        "job decides it) or change the job"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env,first,flags", [
    # TrainJob v2, pod 1 of 2, its default numProcPerNode: one process a GPU, else 1.
    (dict(POD, PET_NNODES="2", PET_NPROC_PER_NODE="auto", PET_NODE_RANK="1", PET_MASTER_ADDR="127.0.0.1",
          PET_MASTER_PORT="29500"),
     "kubernetes (TrainJob): pod 1 of 2 (PET_NODE_RANK), 1 process a pod (auto), master 127.0.0.1:29500",
     "--nproc-per-node=1 --nnodes=2 --max-restarts=0 --node-rank=1 --master-addr=127.0.0.1 --master-port=29500"),
    # An elastic PyTorchJob (elasticPolicy: minReplicas 2, maxReplicas 3, maxRestarts 5; Worker replicas only).
    (dict(POD, PET_RDZV_ENDPOINT="127.0.0.1:29400", PET_RDZV_BACKEND="c10d", PET_NNODES="2:3", PET_MAX_RESTARTS="5",
          PET_NPROC_PER_NODE="1", PET_STANDALONE=""),
     "kubernetes (PyTorchJob, elastic): 2 to 3 pods, 1 process a pod, rendezvous at 127.0.0.1:29400",
     "--nproc-per-node=1 --nnodes=2:3 --max-restarts=5 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 "
     "--rdzv-id=scaleloop"),
])
def test_a_pods_variables_become_one_machines_torchrun(tmp_path: Path, env: dict[str, str], first: str,
                                                       flags: str) -> None:
    done = train(tmp_path, env, "--data", "random", probe=True)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.splitlines()
    assert said[0] == f"scaleloop: {first}"
    assert "no torch" in said                  # no GPU driver here: auto is 1 without importing torch
    started = said[said.index("no torch") + 1]
    assert f" {flags} " in started, started
    assert said[said.index("no torch") + 2] == "passed on: []"   # PET_STANDALONE would make a job of one pod


# --- a replica group started on its own: its index from the job (docs/fault-tolerance.md) --------
def group_on_its_own(**settings: object) -> "TrainConfig":
    from scaleloop.config import TrainConfig

    return TrainConfig(replica_groups=2, lighthouse="lh:29510", nproc=1, batch_size=64, **settings).validate()


@pytest.mark.parametrize("variables, index, source", [
    ({"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"}, 1, "REPLICA_GROUP_ID=1"),
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}, 0, "SLURM_ARRAY_TASK_ID=0"),
    ({"REPLICA_GROUP_ID": "1", "SLURM_ARRAY_TASK_ID": "1"}, 1, "REPLICA_GROUP_ID=1"),   # agreeing
])
def test_a_groups_index_comes_from_its_job_in_one_line(variables: dict[str, str], index: int, source: str) -> None:
    from scaleloop.launching.jobs import replica_group_in_job

    cfg, said = replica_group_in_job(group_on_its_own(), variables, {})
    assert cfg.launch.replica_group == index and cfg.launch.data_ranks == 2
    assert said == f"replica group {index} of 2, as this job's {source} says"


def test_a_typed_or_configured_index_needs_no_line_and_the_one_machine_form_reads_nothing() -> None:
    from scaleloop.config import TrainConfig
    from scaleloop.launching.jobs import replica_group_in_job

    typed = group_on_its_own(replica_group=1)
    assert replica_group_in_job(typed, {"REPLICA_GROUP_ID": "1"}, {"replica_group": 1}) == (typed, None)
    # A config file's index (the one-machine launcher's group-I.toml) decides, whatever the job says.
    assert replica_group_in_job(typed, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}, {}) == (typed, None)
    all_here = TrainConfig(replica_groups=2, nproc=2, batch_size=64).validate()
    assert replica_group_in_job(all_here, {"REPLICA_GROUP_ID": "1"}, {}) == (all_here, None)


@pytest.mark.parametrize("variables, typed, message", [
    ({}, None, "--lighthouse lh:29510 starts one replica group of 2, and nothing says which: add --replica-group I "
               "(or run it where REPLICA_GROUP_ID or SLURM_ARRAY_TASK_ID says it)"),
    ({"REPLICA_GROUP_ID": "0", "SLURM_ARRAY_TASK_ID": "1"}, None,
     "this job's variables name two replica groups (REPLICA_GROUP_ID=0 and SLURM_ARRAY_TASK_ID=1): give --replica-group I"),
    ({"REPLICA_GROUP_ID": "0"}, 1, "--replica-group 1 contradicts this job's REPLICA_GROUP_ID=0: drop the flag (the job "
                                   "decides it) or change the job"),
    ({"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "4"}, None,
     "--replica-groups 2 contradicts this job's NUM_REPLICA_GROUPS=4: start as many groups as the job has, or change "
     "the job"),
    ({"SLURM_ARRAY_TASK_ID": "2"}, None,
     "this job's SLURM_ARRAY_TASK_ID=2 is not one of --replica-groups 2 (0..1): number the array from 0 (--array 0-1)"),
    ({"REPLICA_GROUP_ID": "one"}, None, "this job's REPLICA_GROUP_ID=one is not one of --replica-groups 2 (0..1)"),
])
def test_an_index_the_job_contradicts_or_leaves_open_is_one_line(variables: dict[str, str], typed: object,
                                                                  message: str) -> None:
    from scaleloop.errors import UsageError
    from scaleloop.launching.jobs import replica_group_in_job

    cfg = group_on_its_own(replica_group=typed) if typed is not None else group_on_its_own()
    with pytest.raises(UsageError) as err:
        replica_group_in_job(cfg, variables, {"replica_group": typed} if typed is not None else {})
    assert str(err.value) == message


def test_a_contradicting_index_stops_the_command_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command line: ``scaleloop: error: ...``, exit 2, before anything starts."""
    from scaleloop.cli import main

    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    code = main(["train", "--replica-groups", "2", "--replica-group", "1", "--lighthouse", "lh:29510", "--nproc", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("scaleloop: error: --replica-group 1 contradicts this job's REPLICA_GROUP_ID=0: drop "
                                 "the flag (the job decides it) or change the job\n"), err
