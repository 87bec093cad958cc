"""``scaleloop train`` in the job that started it, decided before anything waits on a peer.

- In a **Kubeflow pod** (PyTorchJob or TrainJob) the same command on every pod makes each pod one
  machine of a several-machine job: the pod's variables become ``--nnodes``, ``--node-rank``,
  ``--nproc`` and the master address (or the c10d rendezvous of an elastic PyTorchJob), and the
  launcher starts torchrun on the pod as it does for ``--nnodes``: per-rank logs, and a verified
  copy of every checkpoint on each pod that does not share the run directory.
- **Leftover** launcher variables (``RANK=1 WORLD_SIZE=2`` in a shell, with no launcher) are
  ignored, in one line, where ``--nproc`` was given or they describe one process; otherwise the
  run stops in one line that names them and says what to do.

- A **replica group started on its own** (``--replica-groups N --lighthouse HOST:PORT``) without
  ``--replica-group`` takes its index from where its job says it: ``REPLICA_GROUP_ID`` (torchft's
  own variable: its torchx component sets it, with ``NUM_REPLICA_GROUPS``, in each group's
  containers, and its examples read it; a Kubernetes Job per group sets it in ``env``), or
  ``SLURM_ARRAY_TASK_ID`` (one task of a SLURM job array per group, ``sbatch --array 0-(N-1)``;
  ``SLURM_ARRAY_TASK_COUNT`` is its count). One line says which.

A flag given on the command line that the job contradicts (``--nproc 3`` in a pod of 2
processes) is one line and a non-zero exit, never a job that waits for processes nobody starts.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.launching.torchrun import NVIDIA_CONTROL_DEVICE
from scaleloop.runtime.cluster import KUBEFLOW, LEFTOVER, LEFTOVER_NAMES, ClusterJob
from scaleloop.runtime.kubeflow import KubeflowJob

#: Where a replica group's index is read, each with the variable that gives the number of groups
#: beside it: torchft's own (torchx's component), then a SLURM job array's.
REPLICA_GROUP_VARIABLES = {"REPLICA_GROUP_ID": "NUM_REPLICA_GROUPS", "SLURM_ARRAY_TASK_ID": "SLURM_ARRAY_TASK_COUNT"}


def settings_in_job(cfg: TrainConfig, job: ClusterJob, given: Mapping[str, Any]) -> tuple[TrainConfig, Optional[str]]:
    """``cfg`` as it runs in ``job``, and the line to print first (None: nothing to say).

    ``given``: the flags of this command line as typed (``{"nproc": "auto"}``): they must agree
    with a Kubeflow job, which decides what ``--nproc auto`` leaves open, and ``--nproc`` wins over
    leftover variables. UsageError (one line) otherwise.
    """
    if job.kind == KUBEFLOW and job.kubeflow is not None:
        placed = _in_pod(cfg, job.kubeflow, given)
        return placed, job.kubeflow.describe(placed.nproc)
    if job.kind == LEFTOVER:
        return cfg, _leftover_line(job, given)
    return cfg, None


def _in_pod(cfg: TrainConfig, pod: KubeflowJob, given: Mapping[str, Any]) -> TrainConfig:
    nproc = processes_a_machine(pod.nproc, "PET_NPROC_PER_NODE")
    job: dict[str, object] = {"nproc": nproc, "nnodes": pod.nnodes}
    if pod.elastic:
        job.update(min_nnodes=pod.min_nnodes if pod.min_nnodes < pod.nnodes else 0, node_rank=0,
                   master_addr=None, rdzv_endpoint=pod.rdzv_endpoint)
        if pod.rdzv_id is not None:
            job["rdzv_id"] = pod.rdzv_id
        if pod.rdzv_conf is not None:
            job["rdzv_conf"] = pod.rdzv_conf
    else:
        job.update(min_nnodes=0, node_rank=pod.node_rank, master_addr=pod.master_addr,
                   master_port=pod.master_port, rdzv_endpoint=None)
    if pod.max_restarts is not None:
        job["max_restarts"] = pod.max_restarts
    # The settings a flag on this command line may give too, and the variable each comes from.
    variables = {"nproc": "PET_NPROC_PER_NODE", "nnodes": "PET_NNODES", "max_restarts": "PET_MAX_RESTARTS"}
    variables.update({"rdzv_endpoint": "PET_RDZV_ENDPOINT", "rdzv_id": "PET_RDZV_ID", "rdzv_conf": "PET_RDZV_CONF"}
                     if pod.elastic else
                     {"node_rank": "PET_NODE_RANK", "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"})
    for name, variable in variables.items():
        if name not in given or name not in job or cfg.setting(name) == job[name]:
            continue
        if name == "nproc" and given["nproc"] == "auto":
            continue                      # --nproc auto: the job's count (its own auto resolved alike)
        if name == "nproc" and pod.nproc in ("auto", "cpu", "gpu"):
            job["nproc"] = cfg.launch.nproc      # the job leaves the count to the pod: the flag decides it
            continue
        shown = pod.nproc if name == "nproc" else job[name]
        raise UsageError(f"--{name.replace('_', '-')} {cfg.setting(name)} contradicts this pod's {pod.api} "
                         f"({variable}={shown}): drop the flag (the job decides it) or change the job")
    return cfg.replace(**job).validate()


def replica_group_in_job(cfg: TrainConfig, environ: Mapping[str, str],
                         given: Mapping[str, Any]) -> tuple[TrainConfig, Optional[str]]:
    """``cfg`` with its replica group's index where the job says it (module doc), and the line that
    says where it came from (None: nothing read). Only for a group started on its own
    (``--lighthouse``); UsageError (one line) when the variables contradict each other or the flags."""
    if not (cfg.launch.replica_groups > 1 and cfg.launch.lighthouse is not None):
        return cfg, None
    typed = given.get("replica_group")
    if cfg.launch.replica_group is not None and typed is None:
        return cfg, None   # from a config file (the one-machine launcher's group-I.toml, a run resumed): it decides
    found = _replica_group_variables(environ, cfg.launch.replica_groups)
    if typed is not None:
        for name, value in found.items():
            if value != str(typed).strip():
                raise UsageError(f"--replica-group {typed} contradicts this job's {name}={value}: drop the flag "
                                 "(the job decides it) or change the job")
        return cfg, None
    if not found:
        raise UsageError(f"--lighthouse {cfg.launch.lighthouse} starts one replica group of {cfg.launch.replica_groups}, and nothing "
                         f"says which: add --replica-group I (or run it where {' or '.join(REPLICA_GROUP_VARIABLES)} "
                         "says it)")
    name, value = next(iter(found.items()))
    if not value.isdigit() or int(value) >= cfg.launch.replica_groups:
        hint = f": number the array from 0 (--array 0-{cfg.launch.replica_groups - 1})" if name.startswith("SLURM") else ""
        raise UsageError(f"this job's {name}={value} is not one of --replica-groups {cfg.launch.replica_groups} "
                         f"(0..{cfg.launch.replica_groups - 1}){hint}")
    return (cfg.replace(replica_group=int(value)).validate(),
            f"replica group {value} of {cfg.launch.replica_groups}, as this job's {name}={value} says")


def _replica_group_variables(environ: Mapping[str, str], groups: int) -> dict[str, str]:
    """The job's variables that name this replica group (``NAME: value``); UsageError where two name
    different groups, or the count beside one (``NUM_REPLICA_GROUPS``...) is not ``groups``."""
    found = {name: environ[name].strip() for name in REPLICA_GROUP_VARIABLES if environ.get(name, "").strip()}
    if len(set(found.values())) > 1:
        said = " and ".join(f"{name}={value}" for name, value in found.items())
        raise UsageError(f"this job's variables name two replica groups ({said}): give --replica-group I")
    for name in found:
        count_name = REPLICA_GROUP_VARIABLES[name]
        count = environ.get(count_name, "").strip()
        if count and count != str(groups):
            raise UsageError(f"--replica-groups {groups} contradicts this job's {count_name}={count}: start as many "
                             "groups as the job has, or change the job")
    return found


def _leftover_line(job: ClusterJob, given: Mapping[str, Any]) -> str:
    names = ", ".join(job.leftover)
    if "nproc" in given or job.leftover_world <= 1:
        why = f"--nproc {given['nproc']} decides" if "nproc" in given else "they describe one process"
        return (f"note: ignoring {names} left in the environment (no torchrun, srun or Kubeflow job started "
                f"this process; {why})")
    unset = " ".join(job.leftover_names)
    raise UsageError(f"{names} are set, but no torchrun, srun or Kubeflow job started this process (left from an "
                     f"earlier job or a notebook?): run `unset {unset}` first, or give --nproc N to start N "
                     "workers here")


def processes_a_machine(value: Union[int, str], source: str = "--nproc") -> int:
    """Processes on this machine for a count or torchrun's words: ``auto`` is one a GPU, else 1
    (torchrun's ``auto`` starts one a CPU core on a machine without GPUs, where several processes
    only share the same cores); ``gpu`` one a GPU (refused without any); ``cpu`` one a core, as
    torchrun's."""
    if isinstance(value, int):
        return value
    if value == "cpu":
        return os.cpu_count() or 1
    gpus = visible_gpus()
    if value == "gpu" and gpus == 0:
        raise UsageError(f"{source}=gpu asks for one process a GPU, and this machine has none")
    return max(gpus, 1)


def visible_gpus() -> int:
    """The CUDA devices this process may use; torch is imported only where an NVIDIA driver is."""
    if not os.path.exists(NVIDIA_CONTROL_DEVICE):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def without_job_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less what a launcher or a Kubeflow operator set, for torchrun and its workers:
    torchrun reads ``PET_*`` as defaults of its flags (``PET_STANDALONE`` would turn a pod's job
    into a job of one), and sets its workers' ``RANK``... itself. The launcher passes on what it
    read as flags."""
    return {k: v for k, v in environ.items() if not k.startswith("PET_") and k not in LEFTOVER_NAMES}
