"""Who this process is in a SLURM job, read from the variables ``srun`` sets for each task.

Under ``srun`` (without torchrun) every task is one worker: SLURM_PROCID is its rank,
SLURM_NTASKS the world size, SLURM_LOCALID the rank on its node. SLURM gives no rendezvous
address, so the first host of the step's node list is the master (rank 0 runs there under
SLURM's block and cyclic distributions) and the port is derived from the job id, so every
task computes the same address without talking to the others.

Pure functions on a mapping of environment variables: no torch, nothing read from
``os.environ`` here (``scaleloop.runtime.dist`` passes it in).
"""
from __future__ import annotations

import re
import subprocess
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from scaleloop.errors import UsageError

#: Ports derived from the job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): above the
#: usual service ports and below Linux's ephemeral range (32768+), where they would
#: collide with outgoing connections.
PORT_BASE = 15000
PORT_SPAN = 10000


#: Every variable :func:`task_from_env` may read, in the order a line names them.
TASK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID",
                  "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                  "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                  "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class SlurmTask:
    """This task's place in an ``srun`` job step, and where rank 0 listens.

    ``job`` and ``step``: SLURM's ids (as given; "" when absent); ``read``: the variables the task
    was read from, for the line that says so (a shell may hold them long after its job ended).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job: str = ""
    step: str = ""
    read: tuple[str, ...] = ()

    @property
    def rendezvous(self) -> str:
        """``host:port`` of rank 0's store (IPv6 hosts in brackets)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    def describe(self) -> str:
        """Who this task is, e.g. ``rank 1 of 2 of SLURM job 1, step 0``."""
        return f"rank {self.rank} of {self.world_size} of SLURM job {self.job or '?'}, step {self.step or '?'}"

    def unset_command(self) -> str:
        """The shell command that drops the variables this task was read from."""
        return "unset " + " ".join(self.read)


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """True inside a task started by ``srun`` (not in the batch script itself).

    The batch script of ``sbatch --ntasks 4`` also sees SLURM_PROCID=0 and SLURM_NTASKS=4,
    but it is one process: treating it as rank 0 of 4 would wait forever for the other three.
    Only srun's tasks belong to a job *step*, and only they get SLURM_STEP_ID.
    """
    has_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    return has_step and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ


def task_from_env(environ: Mapping[str, str]) -> Optional[SlurmTask]:
    """This task's ranks and master address, or None when not an ``srun`` task.

    MASTER_ADDR / MASTER_PORT, when set, win over the node list and the job id (for clusters
    where the node names do not resolve, or two concurrent steps of one job).
    """
    if not in_srun_step(environ):
        return None
    try:
        rank = int(environ["SLURM_PROCID"])
        world_size = int(environ["SLURM_NTASKS"])
        local_rank = int(environ.get("SLURM_LOCALID", "0"))
        local_world_size = _local_world_size(environ, world_size)
        master_port = int(environ["MASTER_PORT"]) if environ.get("MASTER_PORT") else None
    except ValueError as exc:
        raise UsageError(f"SLURM environment is malformed: {exc}") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"SLURM environment: SLURM_PROCID={rank} is outside SLURM_NTASKS={world_size}")
    # One task needs no rendezvous, so it does not need a node list either.
    master_addr = environ.get("MASTER_ADDR") or (first_host(_nodelist(environ)) if world_size > 1 else "localhost")
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID", "")
    if master_port is None:
        master_port = port_for_job(job)
    return SlurmTask(rank=rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=local_world_size, master_addr=master_addr, master_port=master_port,
                     job=job, step=environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID", ""),
                     read=tuple(name for name in TASK_VARIABLES if name in environ))


def _nodelist(environ: Mapping[str, str]) -> str:
    # The step's own list first: `srun -N1` inside a two-node allocation runs on a subset.
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(key):
            return environ[key]
    raise UsageError("SLURM environment has no node list (SLURM_JOB_NODELIST); set MASTER_ADDR to rank 0's host")


def _local_world_size(environ: Mapping[str, str], world_size: int) -> int:
    """Tasks on this node: this node's entry of the tasks-per-node list when SLURM_NODEID says which."""
    per_node_list = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node_list:
        counts = parse_tasks_per_node(per_node_list)
        node_id = environ.get("SLURM_NODEID")
        if node_id is not None and 0 <= int(node_id) < len(counts):
            return counts[int(node_id)]
        if len(set(counts)) == 1:
            return counts[0]
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return int(environ["SLURM_NTASKS_PER_NODE"])
    return world_size


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's run-length form: ``"2(x3),1"`` is ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise UsageError(f"SLURM tasks-per-node {value!r} is malformed (expected e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def parse_nodelist(value: str) -> list[str]:
    """Expand a compressed host list: ``"node[01-03,07],gpu5"`` is node01 node02 node03 node07 gpu5.

    Zero padding is kept (``01-03``), and several bracket groups in one name expand as a
    product (``"r[1-2]n[1-2]"`` is r1n1 r1n2 r2n1 r2n2), as ``scontrol show hostnames`` does.
    """
    hosts: list[str] = []
    for item in _split_top_level(value):
        hosts += _expand_host(item, value)
    if not hosts:
        raise UsageError(f"SLURM node list {value!r} is empty")
    return hosts


def first_host(value: str) -> str:
    """The first host of a compressed node list (rank 0's node)."""
    return parse_nodelist(value)[0]


def port_for_job(job_id: str) -> int:
    """A port in [15000, 25000) that every task of a job computes alike from SLURM_JOB_ID.

    Consecutive job ids get different ports, so jobs that share a first node do not collide.
    """
    if job_id.isdigit():
        offset = int(job_id) % PORT_SPAN
    else:
        # No (or an odd) job id: still the same on every task, but arbitrary.
        offset = zlib.crc32(job_id.encode()) % PORT_SPAN
    return PORT_BASE + offset


def _split_top_level(value: str) -> list[str]:
    """Split on the commas that separate hosts, not those inside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(value):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"SLURM node list {value!r} has an unmatched ']'")
        elif char == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
    if depth != 0:
        raise UsageError(f"SLURM node list {value!r} has an unmatched '['")
    items.append(value[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(pattern: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[:match.start()], pattern[match.end():]
    expanded: list[str] = []
    for part in match.group(1).split(","):
        for number in _expand_range(part.strip(), whole):
            expanded += _expand_host(prefix + number + suffix, whole)
    return expanded


def _expand_range(part: str, whole: str) -> list[str]:
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
    if match is None:
        raise UsageError(f"SLURM node list {whole!r} has a bad range {part!r}")
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
        raise UsageError(f"SLURM node list {whole!r} has a descending range {part!r}")
    width = len(low)  # "01-03" keeps two digits; "1-3" none
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    """Whether this process belongs to a SLURM job (batch script, srun task or a process they
    started): SLURM then signals it directly when it preempts the job or its time runs out."""
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def requeue(environ: Mapping[str, str], run: Callable[..., Any] = subprocess.run) -> str:
    """``scontrol requeue $SLURM_JOB_ID`` (``--requeue``): the job goes back into the queue and
    continues from its checkpoint when it starts again. Returns what happened, for the log line."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return "--requeue: not in a SLURM job (no SLURM_JOB_ID), nothing to requeue"
    try:
        done = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"--requeue: scontrol requeue {job} could not run ({exc}); requeue the job by hand"
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout or "").split())[:200]
        return (f"--requeue: scontrol requeue {job} failed ({said or f'exit {done.returncode}'}); "
                "the job may need sbatch --requeue; requeue it by hand")
    return f"job {job} requeued (scontrol requeue {job})"
