"""Which job this process is in, read from its environment alone: the one place that tells a
torchrun worker, an ``srun`` task, a Kubeflow pod and a plain process apart.

``scaleloop train`` asks it first, before anything waits on a peer: a worker trains, a pod
becomes one machine of a several-machine job (``scaleloop.launching.jobs``), and a plain process
whose shell still holds ``RANK``/``WORLD_SIZE``/``MASTER_*`` from an earlier job (or a notebook)
is told so in one line instead of waiting for peers that will never come.

How a leftover is told from a real worker: torchrun's agent gives every worker
``TORCHELASTIC_RUN_ID`` (with ``GROUP_RANK``, ``ROLE_RANK``, ``TORCHELASTIC_RESTART_COUNT``...;
torch's ``local_elastic_agent.py``), ``srun`` gives every task of a step ``SLURM_STEP_ID``, a
Kubeflow operator gives every pod ``PET_*`` variables, and a Ray worker (and every process it
starts) holds ``RAY_RAYLET_PID`` beside the variables of Ray's process group. ``RANK`` and ``WORLD_SIZE`` with none of
these were set by no launcher scaleloop knows.

No torch here: the launcher reads it before deciding whether to import anything slow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from scaleloop.runtime import kubeflow
from scaleloop.runtime.started import launched_by_slurm

#: The variables a launcher sets for a worker, which a plain process may have been left with.
LEFTOVER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

PLAIN, TORCHRUN, SRUN, RAY, KUBEFLOW, LEFTOVER = "plain", "torchrun", "srun", "ray", "kubeflow", "leftover"
# Ray's process group: what a Ray Train worker (``TorchTrainer``) is given, and what its children inherit.
_RAY_GROUP = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ClusterJob:
    """What started this process: ``kind`` is one of plain, torchrun, srun, ray, kubeflow, leftover.

    ``kubeflow``: the pod's job (for ``kind == "kubeflow"``); ``leftover``: the launcher variables
    a plain process was left with, as ``NAME=value``.
    """

    kind: str
    kubeflow: Optional[kubeflow.KubeflowJob] = None
    leftover: tuple[str, ...] = ()

    @property
    def is_worker(self) -> bool:
        """Whether this process is one worker of a job that a launcher started (it trains as it is)."""
        return self.kind in (TORCHRUN, SRUN, RAY)

    @property
    def leftover_names(self) -> tuple[str, ...]:
        return tuple(item.partition("=")[0] for item in self.leftover)

    @property
    def leftover_world(self) -> int:
        """The world size the leftover variables describe (1 without ``WORLD_SIZE`` or with a bad one)."""
        for item in self.leftover:
            name, _, value = item.partition("=")
            if name == "WORLD_SIZE":
                return int(value) if value.strip().isdigit() else 1
        return 1


def read_job(environ: Mapping[str, str]) -> ClusterJob:
    """The job this process is in; UsageError (one line) for a Kubeflow pod whose variables
    contradict each other."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return ClusterJob(TORCHRUN)
    if launched_by_slurm(environ):
        return ClusterJob(SRUN)
    if in_ray_group(environ):
        return ClusterJob(RAY)
    if kubeflow.in_kubeflow_job(environ):
        return ClusterJob(KUBEFLOW, kubeflow=kubeflow.job_from_env(environ))
    left = tuple(f"{name}={environ[name]}" for name in LEFTOVER_NAMES if name in environ)
    return ClusterJob(LEFTOVER, leftover=left) if left else ClusterJob(PLAIN)


def in_ray_group(environ: Mapping[str, str]) -> bool:
    """Whether this process holds a Ray Train worker's process-group variables: it is that worker,
    or a process the worker started (``scaleloop.ray`` tells the two apart). A torchrun started
    from a Ray worker gives its own workers their own group (``TORCHELASTIC_RUN_ID``)."""
    return ("RAY_RAYLET_PID" in environ and all(name in environ for name in _RAY_GROUP)
            and "TORCHELASTIC_RUN_ID" not in environ)
