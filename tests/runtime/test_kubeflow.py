"""Which job a process is in (``runtime.cluster.read_job``) from the variables each launcher sets,
and docs/kubernetes.md's manifests checked against the variables the operators derive from them.

``pytorchjob_env`` and ``trainjob_env`` derive a pod's variables from a manifest the way the
operators' code does (cited in docs/kubernetes.md: training-operator's envvar.go, master.go and
elastic.go; Trainer's torch.go), so that a manifest in the docs that the operator would turn into
something scaleloop reads differently fails here. tests/distributed/test_doc_commands_dist.py runs
each manifest's pods with these variables.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scaleloop.config import resolve
from scaleloop.errors import UsageError
from scaleloop.launching.jobs import processes_a_machine, settings_in_job
from scaleloop.runtime.cluster import KUBEFLOW, LEFTOVER, PLAIN, RAY, SRUN, TORCHRUN, read_job

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pytorchjob_env(job: dict[str, Any], rtype: str, index: int) -> dict[str, str]:
    """The variables training-operator gives pod ``index`` of replica type ``rtype`` (setPodEnv)."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(r["replicas"] for r in replicas.values())
    env = dict(POD, PYTHONUNBUFFERED="0")

    def port(kind: str) -> int:
        for container in replicas[kind]["template"]["spec"]["containers"]:
            if container["name"] == "pytorch":
                for p in container.get("ports", []):
                    if p["name"] == "pytorchjob-port":
                        return p["containerPort"]
        raise AssertionError(f"{kind}: no container 'pytorch' with a port 'pytorchjob-port'")

    if "Master" in replicas:
        nproc = spec.get("nprocPerNode", "auto")
        master = f"{name}-master-0"
        rank = index + 1 if rtype == "Worker" else index
        env.update(MASTER_PORT=str(port("Master")), PET_MASTER_PORT=str(port("Master")), MASTER_ADDR=master,
                   PET_MASTER_ADDR=master, WORLD_SIZE=str(total * (int(nproc) if nproc.isdigit() else 1)),
                   RANK=str(rank), PET_NPROC_PER_NODE=nproc, PET_NODE_RANK=str(rank))
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    host = elastic.get("rdzvHost", f"{name}-worker-0")
    env["PET_RDZV_ENDPOINT"] = f"{host}:{elastic.get('rdzvPort', port('Worker'))}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    if "minReplicas" in elastic or "maxReplicas" in elastic:
        env["PET_NNODES"] = f"{elastic.get('minReplicas')}:{elastic.get('maxReplicas')}"
    else:
        env["PET_NNODES"] = str(replicas["Worker"]["replicas"])
    for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE"), ("rdzvId", "PET_RDZV_ID")):
        if key in elastic:
            env[var] = str(elastic[key])
    return env


def trainjob_env(job: dict[str, Any], index: int, runtime_nproc: str = "auto", runtime_nodes: int = 1) -> dict[str, str]:
    """The variables Trainer's torch plugin gives pod ``index`` (EnforceMLPolicy), for the
    ``torch-distributed`` runtime (numProcPerNode auto, one node unless the job says)."""
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    nproc = str(trainer.get("numProcPerNode", runtime_nproc))
    resources = trainer.get("resourcesPerNode")
    if resources is not None and nproc in ("auto", "cpu"):
        def uses_cpu(listed: dict[str, Any]) -> bool:
            if nproc == "auto":
                return not any("gpu" in key.lower() for key in listed)
            return "cpu" in listed

        for listed in (resources.get("limits"), resources.get("requests")):   # calculateNumProcPerNode
            if listed is None:
                nproc = "1"
                break
            if uses_cpu(listed):
                nproc = str(max(1, int(listed.get("cpu", 1))))
                break
    return dict(POD, PET_NNODES=str(trainer.get("numNodes", runtime_nodes)), PET_NPROC_PER_NODE=nproc,
                PET_NODE_RANK=str(index), PET_MASTER_ADDR=f"{name}-node-0-0.{name}", PET_MASTER_PORT="29500")


def doc_manifests() -> dict[str, dict[str, Any]]:
    """docs/kubernetes.md's YAML blocks by ``kind`` (an elastic PyTorchJob as ``PyTorchJob-elastic``;
    the TrainJob's part for Trainer v2.1, a manifest's ``spec`` alone, as ``TrainJob-v2.1``)."""
    found: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S):
        doc = yaml.safe_load(block)
        if "kind" not in doc and "podTemplateOverrides" in doc.get("spec", {}):
            found["TrainJob-v2.1"] = doc
            continue
        kind = doc["kind"] + ("-elastic" if "elasticPolicy" in doc.get("spec", {}) else "")
        found[kind] = doc
    return found


def out_of(command: list[str]) -> str:
    assert command[:2] == ["scaleloop", "train"], command
    return command[command.index("--out") + 1]


def check_volume(out: str, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]], claim: str) -> None:
    mount = next(m for m in mounts if out.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in volumes if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == claim, "--out must be on the persistent volume"


def test_the_docs_pytorchjob_gives_every_pod_its_place_and_the_same_command() -> None:
    manifests = doc_manifests()
    claim = manifests["PersistentVolumeClaim"]["metadata"]["name"]
    job = manifests["PyTorchJob"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    commands = set()
    for rtype, replica in replicas.items():
        pod = replica["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == "pytorch")
        assert container["image"] and container["resources"]["limits"]
        commands.add(tuple(container["command"]))
        check_volume(out_of(container["command"]), container["volumeMounts"], pod["volumes"], claim)
    assert len(commands) == 1, "every pod runs the same command"

    pods = [("Master", 0), ("Worker", 0)]
    cfg = resolve({}, {})
    for node, (rtype, index) in enumerate(pods):
        found = read_job(pytorchjob_env(job, rtype, index))
        assert found.kind == KUBEFLOW and found.kubeflow is not None
        assert found.kubeflow.describe() == (f"kubernetes (PyTorchJob): pod {node} of 2 (PET_NODE_RANK), 2 processes a "
                                             "pod, master digits-ddp-master-0:23456")
        placed, said = settings_in_job(cfg, found, {})
        assert (placed.nnodes, placed.nproc, placed.node_rank, placed.master_addr, placed.master_port) == \
            (2, 2, node, "digits-ddp-master-0", 23456)
        assert placed.world_size == 4 and said == found.kubeflow.describe()


def test_the_docs_elastic_pytorchjob_meets_at_its_rendezvous() -> None:
    job = doc_manifests()["PyTorchJob-elastic"]
    found = read_job(pytorchjob_env(job, "Worker", 1))
    assert found.kubeflow is not None and found.kubeflow.describe() == (
        "kubernetes (PyTorchJob, elastic): 2 to 3 pods, 1 process a pod, rendezvous at digits-elastic-worker-0:23456")
    placed, _ = settings_in_job(resolve({}, {}), found, {})
    assert (placed.min_nnodes, placed.nnodes, placed.nproc, placed.rdzv_endpoint, placed.max_restarts,
            placed.master_addr) == (2, 3, 1, "digits-elastic-worker-0:23456", 5, None)


def node_patch(job: dict[str, Any]) -> dict[str, Any]:
    """The pod spec that a TrainJob's ``runtimePatches`` (Trainer v2.2 and later) give the runtime's
    ``node`` replicated job: the doc's one patch, by its one manager."""
    patches = job["spec"]["runtimePatches"]
    assert len({p["manager"] for p in patches}) == len(patches) == 1, "one entry, owned by one manager"
    jobs = patches[0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    # Since v2.3 a name the runtime lacks adds a replicated job (strategic merge): it must be the runtime's.
    assert [j["name"] for j in jobs] == ["node"]
    return jobs[0]["template"]["spec"]["template"]["spec"]


def test_the_docs_trainjob_mounts_the_claim_through_its_runtime_patches_and_the_v21_form() -> None:
    manifests = doc_manifests()
    job, claim = manifests["TrainJob"], manifests["PersistentVolumeClaim"]["metadata"]["name"]
    assert "podTemplateOverrides" not in job["spec"], "Trainer v2.2 and later have no podTemplateOverrides"
    pod = node_patch(job)
    mounts = next(c for c in pod["containers"] if c["name"] == "node")["volumeMounts"]
    check_volume(out_of(job["spec"]["trainer"]["command"]), mounts, pod["volumes"], claim)
    # The form for Trainer v2.1 and older gives the same volume and mount.
    [override] = manifests["TrainJob-v2.1"]["spec"]["podTemplateOverrides"]
    assert override["targetJobs"] == [{"name": "node"}]
    assert override["spec"]["volumes"] == pod["volumes"] and override["spec"]["containers"] == pod["containers"]


def test_the_docs_trainjob_reaches_the_pod_as_auto_and_starts_one_process_a_gpu() -> None:
    job = doc_manifests()["TrainJob"]
    # The patches change the pod template, not the variables of Trainer's torch plugin (an
    # assumption for v2.3, stated in docs/kubernetes.md): derived as before, from the trainer.
    env = trainjob_env(job, 1)
    assert env["PET_NPROC_PER_NODE"] == "auto"   # the resources name a GPU: the operator leaves it to the pod
    found = read_job(env)
    assert found.kubeflow is not None and found.kubeflow.api == "TrainJob"
    placed, said = settings_in_job(resolve({}, {}), found, {})
    assert (placed.nnodes, placed.node_rank, placed.master_addr, placed.master_port) == \
        (2, 1, "digits-ddp-node-0-0.digits-ddp", 29500)
    assert placed.nproc == processes_a_machine("auto")
    count = processes_a_machine("auto")
    assert said == (f"kubernetes (TrainJob): pod 1 of 2 (PET_NODE_RANK), {count} process{'es' if count > 1 else ''} "
                    "a pod (auto), master digits-ddp-node-0-0.digits-ddp:29500")


def test_the_docs_jobs_restart_a_failing_pod_only_a_few_times() -> None:
    """A command that fails at every start (a usage error) must not restart for ever under
    ``restartPolicy: OnFailure``: the PyTorchJobs bound the restarts (``runPolicy.backoffLimit``)."""
    manifests = doc_manifests()
    for kind in ("PyTorchJob", "PyTorchJob-elastic"):
        spec = manifests[kind]["spec"]
        policies = {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()}
        assert policies != {"OnFailure"} or 0 < spec.get("runPolicy", {}).get("backoffLimit", 0) <= 10, kind


def test_trainer_turns_auto_into_the_cpu_limit_on_a_cpu_pod() -> None:
    job = {"metadata": {"name": "j"}, "spec": {"trainer": {"numNodes": 2, "resourcesPerNode": {"limits": {"cpu": "3"}}}}}
    assert trainjob_env(job, 0)["PET_NPROC_PER_NODE"] == "3"
    assert read_job(trainjob_env(job, 0)).kubeflow.nproc == 3  # type: ignore[union-attr]


# What each launcher gives a worker; a leftover shell has only the plain variables.
TORCHRUN_WORKER = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
                   "TORCHELASTIC_RESTART_COUNT": "0"}
# A Ray Train worker, and a process it started: Ray's group and the raylet's pid (ray/train/torch/config.py).
RAY_WORKER = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41233",
              "RAY_RAYLET_PID": "4242"}
SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
V1_POD = dict(POD, WORLD_SIZE="4", RANK="1", MASTER_ADDR="j-master-0", MASTER_PORT="23456", PET_MASTER_ADDR="j-master-0",
              PET_MASTER_PORT="23456", PET_NPROC_PER_NODE="2", PET_NODE_RANK="1", PET_NNODES="2")


@pytest.mark.parametrize("env,kind", [
    ({}, PLAIN), (TORCHRUN_WORKER, TORCHRUN), (dict(TORCHRUN_WORKER, **POD, PET_NNODES="2"), TORCHRUN),
    (SRUN_TASK, SRUN), (V1_POD, KUBEFLOW), (RAY_WORKER, RAY),
    (dict(RAY_WORKER, TORCHELASTIC_RUN_ID="none"), TORCHRUN),   # torchrun started from a Ray worker: its own group
    (dict(POD, RANK="0", WORLD_SIZE="2", MASTER_ADDR="j-master-0", MASTER_PORT="23456"), KUBEFLOW),  # before v1.7
    ({"RANK": "1", "WORLD_SIZE": "2"}, LEFTOVER), ({"MASTER_ADDR": "h"}, LEFTOVER),
    (dict(POD, RANK="0", WORLD_SIZE="2"), LEFTOVER),   # a pod, but no operator's full set
])
def test_read_job_tells_each_launcher_from_a_leftover(env: dict[str, str], kind: str) -> None:
    assert read_job(env).kind == kind
    assert read_job(env).is_worker == (kind in (TORCHRUN, SRUN, RAY))


def test_an_old_pytorchjob_is_one_process_a_pod() -> None:
    found = read_job(dict(POD, RANK="1", WORLD_SIZE="3", MASTER_ADDR="j-master-0", MASTER_PORT="23456")).kubeflow
    assert found is not None and (found.nnodes, found.nproc, found.node_rank) == (3, 1, 1)


@pytest.mark.parametrize("change,match", [
    ({"WORLD_SIZE": "6"}, "WORLD_SIZE=6 is not PET_NNODES=2 x PET_NPROC_PER_NODE=2"),
    ({"RANK": "0"}, "RANK=0 is not its PET_NODE_RANK=1"),
    ({"PET_NODE_RANK": "2", "RANK": "2"}, "PET_NODE_RANK=2 is outside its 2 pods"),
    ({"PET_NPROC_PER_NODE": "two"}, "PET_NPROC_PER_NODE='two' is neither"),
    ({"PET_NNODES": "x"}, "PET_NNODES='x' is not a whole number"),
    ({"PET_RDZV_ENDPOINT": "h:1", "PET_RDZV_BACKEND": "etcd"}, "'etcd' rendezvous"),
])
def test_variables_that_contradict_each_other_are_one_line(change: dict[str, str], match: str) -> None:
    with pytest.raises(UsageError, match=re.escape(match)):
        read_job(dict(V1_POD, **change))


@pytest.mark.parametrize("flags,match", [
    ({"nproc": 4}, "--nproc 4 contradicts this pod's PyTorchJob (PET_NPROC_PER_NODE=2)"),
    ({"nnodes": 3, "master_addr": "j-master-0"}, "--nnodes 3 contradicts this pod's PyTorchJob (PET_NNODES=2)"),
    ({"node_rank": 0}, "--node-rank 0 contradicts"),
    ({"master_port": 29500}, "--master-port 29500 contradicts"),
])
def test_a_flag_the_job_contradicts_is_one_line(flags: dict[str, Any], match: str) -> None:
    cfg = resolve({}, {**flags, "batch_size": 64 * 3 * 4})
    with pytest.raises(UsageError, match=re.escape(match)):
        settings_in_job(cfg, read_job(V1_POD), flags)


def test_a_flag_that_agrees_and_nproc_where_the_job_leaves_it_open() -> None:
    placed, _ = settings_in_job(resolve({}, {"nproc": 2}), read_job(V1_POD), {"nproc": "2"})
    assert placed.world_size == 4
    auto = dict(V1_POD, PET_NPROC_PER_NODE="auto", WORLD_SIZE="2")
    placed, _ = settings_in_job(resolve({}, {"nproc": 2}), read_job(auto), {"nproc": "2"})
    assert (placed.nproc, placed.world_size) == (2, 4)
    # --nproc auto never contradicts: the job's own count is the pod's.
    placed, _ = settings_in_job(resolve({}, {"nproc": 1}), read_job(V1_POD), {"nproc": "auto"})
    assert placed.nproc == 2


def test_leftovers_are_refused_unless_nproc_is_given_or_they_describe_one_process() -> None:
    cfg = resolve({}, {})
    with pytest.raises(UsageError, match=re.escape("run `unset RANK WORLD_SIZE` first, or give --nproc N")):
        settings_in_job(cfg, read_job({"RANK": "1", "WORLD_SIZE": "2"}), {})
    _, said = settings_in_job(cfg, read_job({"RANK": "1", "WORLD_SIZE": "2"}), {"nproc": "1"})
    assert said is not None and said.endswith("--nproc 1 decides)")
    _, said = settings_in_job(cfg, read_job({"MASTER_PORT": "29517"}), {})
    assert said is not None and "ignoring MASTER_PORT=29517" in said and "describe one process" in said
