"""Kubeflow pods as network namespaces: the same ``scaleloop train`` on every pod, with exactly the
variables the operators set (docs/kubernetes.md cites their source), trains one job whose final
weights equal ``scaleloop train --nproc 2`` bit for bit.

- a PyTorchJob of 2 pods x 1 process (a Master and a Worker replica);
- a TrainJob of 2 pods with its default ``numProcPerNode: auto`` (one process on a CPU pod);
- a PyTorchJob of 1 pod x 2 processes (``nprocPerNode: "2"``: before, ``--nproc`` was ignored and
  the job waited for 2 processes nobody started);
- a TrainJob of 1 pod x 2 processes (``numProcPerNode: 2``);
- a PyTorchJob of 2 pods x 2 processes (equal to ``--nproc 4``);
- an elastic PyTorchJob (``elasticPolicy``: 2 to 3 Worker pods, a c10d rendezvous on the first).

Each pod has its own run directory (its own volume): per-rank logs on each, and a verified copy of
every checkpoint on the pod without rank 0. The master's service name resolves in each pod's
namespace (``ip netns exec`` reads ``/etc/netns/<pod>/hosts``). The reference run is started with
leftover ``RANK``/``WORLD_SIZE``/``MASTER_*`` in its environment, which ``--nproc 2`` wins over.

The first PyTorchJob's pods start as users' pods do: ``ip netns exec`` and fresh interpreters. The
other jobs' pods are forks of the tests' fork server that join their namespaces as ``ip netns
exec`` does (``forkgroup.py``), their torchrun agents and workers forks too (``forked_launch.py``):
the file's runs took 70 CPU-seconds when every pod started fresh, 22 so.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from netns import Host, can_make_namespaces, two_hosts
from procs import child_env, kill_group, run

FORKGROUP = Path(__file__).resolve().parent / "forkgroup.py"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

reason = can_make_namespaces()
COMMON = ["train", "--data", "random", "--n-samples", "256", "--epochs", "1", "--batch-size", "32", "--max-steps", "6",
          "--checkpoint-every", "3", "--strategy", "ddp", "--optimizer", "sgd", "--lr", "0.1", "--no-progress",
          "--no-tensorboard", "--out", "run"]
LEFTOVER = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
# What Kubernetes itself gives every pod, and what each operator adds (docs/kubernetes.md).
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "PYTHONUNBUFFERED": "0"}


def pytorchjob(rank: int, pods: int, nproc: int) -> dict[str, str]:
    master = {"MASTER_ADDR": "pj-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "pj-master-0",
              "PET_MASTER_PORT": "23456"}
    return {**POD, **master, "WORLD_SIZE": str(pods * nproc), "RANK": str(rank), "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(rank), "PET_NNODES": str(pods)}


def elastic_pytorchjob() -> dict[str, str]:
    """A pod of an elastic PyTorchJob: minReplicas 2, maxReplicas 3, maxRestarts 3, rdzvConf
    ``last_call_timeout=1`` (the round closes 1 s after the minimum has joined, not torch's 30 s)."""
    return {**POD, "PET_RDZV_ENDPOINT": "pj-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:3",
            "PET_MAX_RESTARTS": "3", "PET_NPROC_PER_NODE": "1", "PET_RDZV_CONF": "last_call_timeout=1"}


def trainjob(rank: int, pods: int, nproc: str = "auto") -> dict[str, str]:
    return {**POD, "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29500"}


@contextlib.contextmanager
def pods(tag: str) -> Iterator[tuple[Host, Host]]:
    """Two pods; in both, the masters' service names resolve to the first pod's address."""
    with two_hosts(tag) as (a, b):
        made = []
        try:
            for host in (a, b):
                folder = Path("/etc/netns") / host.namespace
                folder.mkdir(parents=True, exist_ok=True)
                made.append(folder)
                (folder / "hosts").write_text(f"127.0.0.1 localhost\n{a.address} pj-master-0 pj-worker-0 tj-node-0-0.tj\n")
            yield a, b
        finally:
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)


def train_in_pods(where: Path, jobs: list[tuple[Host, dict[str, str]]], fresh: bool = False) -> list[tuple[str, str]]:
    """The same command in each pod (its own directory, its own volume), all at once; each pod's
    output and error. ``fresh``: started by ``ip netns exec``, as users' pods start; otherwise as
    forks (the module's doc)."""
    pods = []
    for i, (host, variables) in enumerate(jobs):
        cwd = where / f"pod{i}"
        cwd.mkdir(parents=True)
        env = {k: v for k, v in child_env().items() if k not in LEFTOVER and not k.startswith("PET_")}
        # GLOO_SOCKET_IFNAME stands in for a pod's host name resolving to its own address.
        env.update(variables, GLOO_SOCKET_IFNAME=host.interface, OMP_NUM_THREADS="1")
        pods.append((host, cwd, env))
    ran = started_fresh(pods) if fresh else forked(pods, where)
    for code, (out, err) in ran:
        assert code == 0, f"a pod failed ({code}):\n{out}\n{err}"
    return [outputs for _, outputs in ran]


def started_fresh(pods: list[tuple[Host, Path, dict[str, str]]]) -> list[tuple[int, tuple[str, str]]]:
    procs = []
    try:
        for host, cwd, env in pods:
            cmd = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "scaleloop", *COMMON]
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def forked(pods: list[tuple[Host, Path, dict[str, str]]], where: Path) -> list[tuple[int, tuple[str, str]]]:
    runs = [{"argv": [sys.executable, "-m", "scaleloop", *COMMON], "env": env, "cwd": str(cwd),
             "stdout": str(cwd / "stdout.txt"), "stderr": str(cwd / "stderr.txt"), "netns": host.namespace}
            for host, cwd, env in pods]
    spec, codes = where / "pods.json", where / "codes.json"
    spec.write_text(json.dumps({"runs": runs, "codes": str(codes)}), encoding="utf-8")
    group = run([sys.executable, str(FORKGROUP), str(spec)], cwd=where, merge=True)
    assert group.returncode == 0 and codes.exists(), f"the pods did not run ({group.returncode}):\n{group.stdout}"
    return [(code, (Path(r["stdout"]).read_text(), Path(r["stderr"]).read_text()))
            for code, r in zip(json.loads(codes.read_text()), runs)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("kubernetes")
    (root / "reference").mkdir()
    reference = run([sys.executable, "-m", "scaleloop", *COMMON, "--nproc", "2"], cwd=root / "reference",
                    env=child_env({**LEFTOVER, "OMP_NUM_THREADS": "1"}))
    assert reference.returncode == 0, reference.stdout + reference.stderr
    (root / "reference4").mkdir()
    reference4 = run([sys.executable, "-m", "scaleloop", *COMMON, "--nproc", "4"], cwd=root / "reference4",
                     env=child_env({"OMP_NUM_THREADS": "1"}))
    assert reference4.returncode == 0, reference4.stdout + reference4.stderr
    found: dict[str, object] = {"reference": reference}
    with pods(f"k{os.getpid() % 100000}") as (a, b):
        found["v1"] = train_in_pods(root / "v1", [(a, pytorchjob(0, 2, 1)), (b, pytorchjob(1, 2, 1))], fresh=True)
        found["v2"] = train_in_pods(root / "v2", [(a, trainjob(0, 2)), (b, trainjob(1, 2))])
        found["v1x2"] = train_in_pods(root / "v1x2", [(a, pytorchjob(0, 1, 2))])
        found["v2x2"] = train_in_pods(root / "v2x2", [(a, trainjob(0, 1, "2"))])
        found["v1x2x2"] = train_in_pods(root / "v1x2x2", [(a, pytorchjob(0, 2, 2)), (b, pytorchjob(1, 2, 2))])
        found["elastic"] = train_in_pods(root / "elastic", [(a, elastic_pytorchjob()), (b, elastic_pytorchjob())])
    found["root"] = root
    return found


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bitwise(run_dir: Path, reference: Path) -> None:
    mine, theirs = weights(run_dir), weights(reference)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), f"{run_dir} differs from {reference}"


def one_job(runs: dict, job: str, first: str, reference: str = "reference") -> tuple[Path, list[str]]:
    """Job ``job``'s folder and each pod's output, once its first pod's first line is ``first`` and its
    weights are those of ``reference`` (bit for bit)."""
    outputs = [out for out, _ in runs[job]]
    assert outputs[0].splitlines()[0] == f"scaleloop: {first}", outputs[0]
    assert_bitwise(runs["root"] / job / "pod0" / "run", runs["root"] / reference / "run")
    return runs["root"] / job, outputs


def rank_logs(pod: Path) -> set[str]:
    return {p.name for p in (pod / "run" / "logs").glob("rank-*.log")}


def test_leftover_variables_give_way_to_nproc(runs: dict) -> None:
    out = runs["reference"].stdout
    assert out.splitlines()[0] == ("scaleloop: note: ignoring RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, "
                                   "MASTER_PORT=29517 left in the environment (no torchrun, srun or Kubeflow job "
                                   "started this process; --nproc 2 decides)")
    assert re.search(r"^  world size +2$", out, re.M), out


def test_pytorchjob_pods_are_the_machines_of_one_job(runs: dict) -> None:
    job, (pod0, pod1) = one_job(runs, "v1", "kubernetes (PyTorchJob): pod 0 of 2 (PET_NODE_RANK), 1 process a pod, "
                                            "master pj-master-0:23456")
    assert pod1.splitlines()[0].startswith("scaleloop: kubernetes (PyTorchJob): pod 1 of 2 (PET_NODE_RANK)")
    # Each pod is one machine: its own rank's log, and a verified copy of every checkpoint.
    assert rank_logs(job / "pod0") == {"rank-0.log"} and rank_logs(job / "pod1") == {"rank-1.log"}
    assert "each keeps a verified copy of every checkpoint" in pod0
    for pod0_file in sorted((job / "pod0" / "run" / "checkpoints").rglob("*")):
        if pod0_file.is_file():
            copy = job / "pod1" / "run" / pod0_file.relative_to(job / "pod0" / "run")
            assert copy.read_bytes() == pod0_file.read_bytes(), copy


def test_trainjob_pods_with_auto_train_one_job(runs: dict) -> None:
    job, (pod0, _) = one_job(runs, "v2", "kubernetes (TrainJob): pod 0 of 2 (PET_NODE_RANK), 1 process a pod (auto), "
                                         "master tj-node-0-0.tj:29500")
    assert re.search(r"^  world size +2$", pod0, re.M), pod0
    assert rank_logs(job / "pod1") == {"rank-1.log"}


def test_a_pytorchjob_pod_of_two_processes_starts_both(runs: dict) -> None:
    job, _ = one_job(runs, "v1x2", "kubernetes (PyTorchJob): pod 0 of 1 (PET_NODE_RANK), 2 processes a pod, "
                                   "master pj-master-0:23456")
    assert rank_logs(job / "pod0") == {"rank-0.log", "rank-1.log"}


def test_a_trainjob_pod_of_two_processes_starts_both(runs: dict) -> None:
    job, _ = one_job(runs, "v2x2", "kubernetes (TrainJob): pod 0 of 1 (PET_NODE_RANK), 2 processes a pod, "
                                   "master tj-node-0-0.tj:29500")
    assert rank_logs(job / "pod0") == {"rank-0.log", "rank-1.log"}


def test_a_pytorchjob_of_two_pods_of_two_processes_equals_four(runs: dict) -> None:
    job, (pod0, _) = one_job(runs, "v1x2x2", "kubernetes (PyTorchJob): pod 0 of 2 (PET_NODE_RANK), 2 processes a pod, "
                                             "master pj-master-0:23456", reference="reference4")
    assert re.search(r"^  world size +4$", pod0, re.M), pod0
    assert rank_logs(job / "pod0") == {"rank-0.log", "rank-1.log"}
    assert rank_logs(job / "pod1") == {"rank-2.log", "rank-3.log"}


def test_an_elastic_pytorchjob_trains_one_job_at_its_rendezvous(runs: dict) -> None:
    root = runs["root"]
    outputs = [out for out, _ in runs["elastic"]]
    assert all(out.splitlines()[0] == ("scaleloop: kubernetes (PyTorchJob, elastic): 2 to 3 pods, 1 process a pod, "
                                       "rendezvous at pj-worker-0:23456") for out in outputs), outputs
    # Which pod is rank 0 is the rendezvous's choice: that pod prints the summary.
    [summary] = [out for out in outputs if re.search(r"^  world size +2$", out, re.M)]
    rank0 = next(pod for pod in (0, 1) if rank_logs(root / "elastic" / f"pod{pod}") == {"rank-0.log"})
    assert_bitwise(root / "elastic" / f"pod{rank0}" / "run", root / "reference" / "run")
    assert rank_logs(root / "elastic" / f"pod{1 - rank0}") == {"rank-1.log"}, summary
