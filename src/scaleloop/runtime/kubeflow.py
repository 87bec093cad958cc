"""A Kubeflow pod's place in its job, read from the variables the training operators set.

Two operators start PyTorch pods, and neither starts torchrun: each pod runs the container's
command once, with torchrun's settings in its environment (docs/kubernetes.md cites the
operators' source for every variable):

- **PyTorchJob** (``kubeflow.org/v1``, training-operator): ``WORLD_SIZE`` (pods x
  ``nprocPerNode``), ``RANK`` and ``PET_NODE_RANK`` (the pod's index: the master 0, worker ``i``
  ``i + 1``), ``PET_NPROC_PER_NODE``, ``PET_NNODES``, ``MASTER_ADDR``/``PET_MASTER_ADDR``
  (``<job>-master-0``) and ``MASTER_PORT``/``PET_MASTER_PORT``. An ``elasticPolicy`` adds
  ``PET_RDZV_ENDPOINT``, ``PET_RDZV_BACKEND``, ``PET_NNODES=MIN:MAX``, and maybe ``PET_RDZV_ID``,
  ``PET_RDZV_CONF``, ``PET_MAX_RESTARTS``, ``PET_STANDALONE``. Operators before v1.7 set only
  ``WORLD_SIZE`` (= pods), ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``: one process a pod.
- **TrainJob** (``trainer.kubeflow.org``, Trainer v2): ``PET_NNODES``, ``PET_NPROC_PER_NODE``
  (default ``auto``), ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` only.

Pure functions of a mapping of variables: no torch, nothing read from ``os.environ`` here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from scaleloop.errors import UsageError

#: The variables that make a pod a Kubeflow job's (any one of them).
SIGNATURE = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
#: Set in every pod by Kubernetes itself (the API server's service).
IN_POD = "KUBERNETES_SERVICE_HOST"
#: What ``PET_NPROC_PER_NODE`` may say besides a number (torchrun's words).
NPROC_WORDS = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class KubeflowJob:
    """This pod's job: how many pods, which one this is, the processes in each, where they meet.

    ``nproc`` is a count or one of torchrun's words (``auto``, ``cpu``, ``gpu``), resolved on the
    pod. ``node_rank`` is None in an elastic job, where the rendezvous decides it.
    """

    api: str                         # "PyTorchJob" or "TrainJob"
    nnodes: int
    nproc: Union[int, str] = 1
    node_rank: Optional[int] = None
    min_nnodes: int = 0              # an elastic job's fewest pods (0: not elastic)
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    rdzv_conf: Optional[str] = None
    max_restarts: Optional[int] = None
    world_size: Optional[int] = None  # PyTorchJob's WORLD_SIZE, as the operator computed it

    @property
    def elastic(self) -> bool:
        """Whether the pods meet at a c10d rendezvous (the PyTorchJob's ``elasticPolicy``)."""
        return self.rdzv_endpoint is not None

    def describe(self, nproc: Optional[int] = None) -> str:
        """The first line of the run: what was read, e.g. ``kubernetes (PyTorchJob): pod 1 of 2, ...``;
        ``nproc``: the count a word (``auto``) came to on this pod."""
        count = self.nproc if nproc is None else nproc
        procs = f"{count} process{'es' if count != 1 else ''} a pod"
        if isinstance(self.nproc, str):
            procs += f" ({self.nproc})"
        if self.elastic:
            pods = f"{self.min_nnodes} to {self.nnodes} pods" if self.min_nnodes < self.nnodes else f"{self.nnodes} pods"
            return f"kubernetes ({self.api}, elastic): {pods}, {procs}, rendezvous at {self.rdzv_endpoint}"
        return (f"kubernetes ({self.api}): pod {self.node_rank} of {self.nnodes} (PET_NODE_RANK), {procs}, "
                f"master {self.master_addr}:{self.master_port}")


def in_kubeflow_job(environ: Mapping[str, str]) -> bool:
    """Whether a Kubeflow operator set this process's variables (one of ``PET_*``'s, or an old
    PyTorchJob's four in a Kubernetes pod)."""
    if any(name in environ for name in SIGNATURE):
        return True
    old = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return IN_POD in environ and all(environ.get(name) for name in old)


def job_from_env(environ: Mapping[str, str]) -> KubeflowJob:
    """This pod's job; UsageError, in one line, when the variables contradict each other.

    Call it where :func:`in_kubeflow_job` is true.
    """
    if "PET_RDZV_ENDPOINT" in environ:
        return _elastic(environ)
    pytorchjob = "WORLD_SIZE" in environ or "RANK" in environ
    api = "PyTorchJob" if pytorchjob else "TrainJob"
    if pytorchjob and not any(name in environ for name in SIGNATURE):   # an operator before v1.7
        world = _int(environ, "WORLD_SIZE")
        return _checked(KubeflowJob(api, nnodes=world, nproc=1, node_rank=_int(environ, "RANK"),
                                    master_addr=_need(environ, "MASTER_ADDR"), master_port=_int(environ, "MASTER_PORT"),
                                    world_size=world))
    prefix = "" if pytorchjob and "PET_MASTER_ADDR" not in environ else "PET_"
    job = KubeflowJob(api, nnodes=_int(environ, "PET_NNODES"), nproc=_nproc(environ),
                      node_rank=_int(environ, "PET_NODE_RANK"),
                      master_addr=_need(environ, f"{prefix}MASTER_ADDR"),
                      master_port=_int(environ, f"{prefix}MASTER_PORT"),
                      max_restarts=_int(environ, "PET_MAX_RESTARTS") if "PET_MAX_RESTARTS" in environ else None,
                      world_size=_int(environ, "WORLD_SIZE") if pytorchjob else None)
    if pytorchjob and _int(environ, "RANK") != job.node_rank:
        raise UsageError(f"this pod's RANK={environ['RANK']} is not its PET_NODE_RANK={job.node_rank}: "
                         "the job's variables contradict each other (set by hand in the manifest?)")
    return _checked(job)


def _elastic(environ: Mapping[str, str]) -> KubeflowJob:
    backend = environ.get("PET_RDZV_BACKEND", "c10d")
    if backend != "c10d":
        raise UsageError(f"this PyTorchJob's elasticPolicy asks for the {backend!r} rendezvous "
                         "(PET_RDZV_BACKEND); scaleloop meets at a c10d one: set rdzvBackend: c10d")
    nodes = _need(environ, "PET_NNODES")
    low, _, high = nodes.partition(":")
    try:
        min_nnodes, nnodes = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"this pod's PET_NNODES={nodes!r} is not N or MIN:MAX") from None
    if not 1 <= min_nnodes <= nnodes:
        raise UsageError(f"this pod's PET_NNODES={nodes!r} needs 1 <= MIN <= MAX")
    return KubeflowJob("PyTorchJob", nnodes=nnodes, min_nnodes=min_nnodes, nproc=_nproc(environ),
                       rdzv_endpoint=environ["PET_RDZV_ENDPOINT"], rdzv_id=environ.get("PET_RDZV_ID") or None,
                       rdzv_conf=environ.get("PET_RDZV_CONF") or None,
                       max_restarts=_int(environ, "PET_MAX_RESTARTS") if "PET_MAX_RESTARTS" in environ else None)


def _checked(job: KubeflowJob) -> KubeflowJob:
    if job.nnodes < 1:
        raise UsageError(f"this pod's job has {job.nnodes} pods (PET_NNODES)")
    if job.node_rank is not None and not 0 <= job.node_rank < job.nnodes:
        raise UsageError(f"this pod's PET_NODE_RANK={job.node_rank} is outside its {job.nnodes} pods (PET_NNODES)")
    # The operator counts a word ("auto") as one process a pod; its WORLD_SIZE then says nothing.
    if job.world_size is not None and isinstance(job.nproc, int) and job.world_size != job.nnodes * job.nproc:
        raise UsageError(f"this pod's WORLD_SIZE={job.world_size} is not PET_NNODES={job.nnodes} x "
                         f"PET_NPROC_PER_NODE={job.nproc}: the job's variables contradict each other")
    return job


def _nproc(environ: Mapping[str, str]) -> Union[int, str]:
    value = environ.get("PET_NPROC_PER_NODE", "1").strip()
    if value in NPROC_WORDS:
        return value
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"this pod's PET_NPROC_PER_NODE={value!r} is neither a positive count nor "
                         f"one of {', '.join(NPROC_WORDS)}")
    return int(value)


def _need(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise UsageError(f"this pod has no {name}, which its Kubeflow job sets: the job's variables are incomplete")
    return value


def _int(environ: Mapping[str, str], name: str) -> int:
    value = _need(environ, name)
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"this pod's {name}={value!r} is not a whole number") from None
