"""The distributed environment as one explicit object, and process-group set-up and teardown.

``DistEnv.from_env`` is the only place that reads the launcher's environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ... from torchrun, or ``SLURM_*`` from ``srun``).
Everything else receives a ``DistEnv``.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as torch_dist

from scaleloop.runtime import slurm
from scaleloop.runtime.started import launched_by_slurm, launched_by_torchrun  # noqa: F401 - named from here too
from scaleloop.runtime.devices import choose_device, device_for_local_rank, mps_available, say_once, visible_gpus
from scaleloop.errors import UsageError


# How long a collective waits for the slowest rank (``--timeout``): torch's own default for a
# process group. A first step under torch.compile, or a large checkpoint written while the
# other ranks wait, can take many minutes; a shorter limit would stop healthy jobs.
DEFAULT_TIMEOUT_S = 1800.0
# Set in its own environment by scaleloop's worker runner (``scaleloop.launching.worker``), which
# records a failed rank's error after the run returns and then leaves the group itself.
RUNNER_RECORDS_VAR = "SCALELOOP_RUNNER_RECORDS_ERRORS"


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and which device and backend it uses.

    A ``DistEnv`` is a plain value: tests build one directly, without a process group.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None
    # Where rank 0 listens, when the launcher did not export MASTER_ADDR/MASTER_PORT (srun);
    # None means the env:// rendezvous reads them from the environment (torchrun).
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    # ``--timeout``: how long any collective of this job waits for the slowest rank, on the
    # default group and on every group the strategies make beside it (``group_timeout``).
    timeout_s: float = DEFAULT_TIMEOUT_S
    # The srun task this was read from (its job, step and variables): its tasks meet with a time
    # limit and say who never came (``scaleloop.runtime.srun_rendezvous``). None: not an srun task.
    srun_task: Optional[slurm.SlurmTask] = field(default=None, repr=False, compare=False)

    @property
    def group_timeout(self) -> timedelta:
        """``timeout_s`` as a new process group takes it (``new_group(timeout=...)``): without it,
        torch gives a group of its own its 30-minute default, whatever the default group's is."""
        return timedelta(seconds=self.timeout_s)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, device: str = "auto",
                 backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "DistEnv":
        """Read rank and world size as set by torchrun, else by ``srun``, else one plain process;
        ``timeout_s`` is the job's ``--timeout``.

        torchrun's variables win: under ``srun ... torchrun`` the workers are torchrun's.
        """
        env = os.environ if environ is None else environ
        task = None if "RANK" in env or "WORLD_SIZE" in env else slurm.task_from_env(env)
        master_addr: Optional[str] = None
        master_port: Optional[int] = None
        if task is None:
            rank, world_size, local_rank, local_world_size = _torchrun_ranks(env)
        else:
            rank, world_size = task.rank, task.world_size
            local_rank, local_world_size = task.local_rank, task.local_world_size
            if world_size > 1:
                master_addr, master_port = task.master_addr, task.master_port
        # NCCL needs one GPU per process: more local processes than GPUs is an error on
        # --device cuda, and the CPU with Gloo under auto (said once per machine).
        choice = choose_device(device, local_world_size, visible_gpus(), mps_available())
        say_once(choice.note, local_rank)
        dev = device_for_local_rank(choice.device, local_rank)
        if backend is None and world_size > 1:
            backend = "nccl" if dev.type == "cuda" else "gloo"
        return cls(rank=rank, local_rank=local_rank, world_size=world_size,
                   local_world_size=local_world_size, device=dev, backend=backend,
                   master_addr=master_addr, master_port=master_port, timeout_s=timeout_s,
                   srun_task=task if task is not None and world_size > 1 else None)


def _torchrun_ranks(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """rank, world size, local rank, local world size from torchrun's variables (defaults: one process)."""
    try:
        rank = int(env.get("RANK", "0"))
        world_size = int(env.get("WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    except ValueError as exc:
        raise UsageError(f"launcher environment is malformed: {exc}") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"launcher environment: RANK={rank} is outside WORLD_SIZE={world_size}")
    return rank, world_size, local_rank, local_world_size


def global_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This worker's rank in the job, as torchrun (or ``srun``) set it; 0 for one plain process."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_ranks(env)[0]
    task = slurm.task_from_env(env)
    return task.rank if task is not None else 0


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times torchrun's elastic agent has restarted this worker group."""
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_process_group(env: DistEnv, timeout_s: Optional[float] = None) -> None:
    """Join the job's process group (a no-op for one process).

    ``env.timeout_s`` bounds every collective: a rank that stops taking part makes the others
    raise after that long (Gloo), or the NCCL watchdog stop them. ``timeout_s``, when given,
    sets the default group's instead; the groups a strategy makes take ``env.timeout_s``, so
    prefer ``DistEnv.from_env(timeout_s=...)``.
    torchrun has already set MASTER_ADDR/MASTER_PORT, so the default ``env://`` rendezvous is
    used; under ``srun`` the address comes from ``env`` (the node list and job id) instead, and the
    tasks meet within the same timeout, saying who never came (``scaleloop.runtime.srun_rendezvous``).
    """
    if not env.is_distributed or torch_dist.is_initialized():
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    init_method = None
    timeout = env.group_timeout if timeout_s is None else timedelta(seconds=timeout_s)
    if env.srun_task is not None:
        from scaleloop.runtime.srun_rendezvous import meet

        store = meet(env.srun_task, timeout.total_seconds(), timeout)
    elif env.master_addr is not None and env.master_port is not None:
        host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr  # IPv6
        init_method = f"tcp://{host}:{env.master_port}"
        store = None
    else:
        store = _per_attempt_store(os.environ, env, timeout)
    torch_dist.init_process_group(
        backend=env.backend, init_method=init_method, store=store, rank=env.rank, world_size=env.world_size,
        timeout=timeout,
        device_id=env.device if env.device.type == "cuda" else None,
    )


def _per_attempt_store(environ: Mapping[str, str], env: DistEnv, timeout: timedelta) -> Optional[torch_dist.Store]:
    """The elastic agent's store, with keys private to this attempt of the worker group.

    torchrun's workers share the agent's TCPStore, and it outlives a restart of the group: the
    keys the failed attempt wrote (each rank's Gloo/NCCL address) are still there, so a
    restarted rank may read a dead peer's address and fail with "connection refused"
    (pytorch/pytorch#167288). A prefix per restart count gives each attempt fresh keys; the world
    size is in it too, because an elastic job's agents restart the group without counting a
    restart when a machine joins (the world then grows).
    None: not under torchrun's agent store, so the default env:// rendezvous is right.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in environ:
        return None
    store = torch_dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), env.world_size,
                                is_master=False, timeout=timeout)
    return torch_dist.PrefixStore(f"scaleloop/attempt-{restart_count(environ)}-w{env.world_size}", store)


def destroy_process_group() -> None:
    """Leave the process group if one was joined.

    DDP wrappers still alive lose their Reducer first (``release_reducer``): held by a strategy
    or by the caller's frame, a wrapper otherwise frees the group later, from a state where the
    group's teardown can wait forever (seen with torch 2.13, about 1 run in 4 on a busy machine).
    A wrapper cannot synchronise once the group is gone; its ``.module`` stays usable.

    The scan also finds wrappers that are already garbage in a reference cycle: the collector
    lists what it tracks until it frees it. So no collection is needed first (one collection of
    everything torch has loaded cost a 2-process run about 0.3 CPU-seconds a rank on the 2-core
    test machine), and when the collector frees such a wrapper later, it has no Reducer left to
    hang in.
    """
    if torch_dist.is_available() and torch_dist.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        for obj in gc.get_objects():
            if issubclass(type(obj), DistributedDataParallel):  # type(): never a proxy's __class__
                release_reducer(obj)
        torch_dist.destroy_process_group()


def end_process_group(*, failed: bool, environ: Optional[Mapping[str, str]] = None) -> None:
    """Leave the process group as a run ends (:func:`destroy_process_group`), except after a failure
    in a rank whose runner records the error afterwards (:data:`RUNNER_RECORDS_VAR`).

    Why: leaving the group tells the other ranks at once (their next collective fails on the lost
    connection). The first of them to fail on it is torchrun's first failure, and torchrun stops
    the rest, this rank included, with SIGTERM: on a busy machine before this rank's error is
    written, and the report then names no error. The runner leaves the group once it is written.
    """
    if failed and (os.environ if environ is None else environ).get(RUNNER_RECORDS_VAR):
        return
    destroy_process_group()


def release_reducer(replica: "torch.nn.parallel.DistributedDataParallel") -> None:
    """Free a DDP wrapper's Reducer now, while its process group is still registered.

    Why: a Reducer that holds the group's last reference destroys the group inside its own
    destructor with the interpreter lock held (torch 2.13), and that joins a Gloo thread which
    may be waiting for the same lock to free a finished collective's tensors: a hang. Released
    while the group is registered, the Reducer never holds the last reference; the group's own
    Python object frees it later, releasing the lock first.
    """
    for name in ("logger", "reducer"):  # the logger holds the Reducer too
        if name in replica.__dict__:
            delattr(replica, name)
