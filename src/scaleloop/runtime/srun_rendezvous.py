"""``srun`` tasks meet at rank 0's store, with a time limit and in Python.

``srun`` gives its tasks no rendezvous: each computes rank 0's address from SLURM's variables
(``scaleloop.runtime.slurm``) and joins there. torch's ``tcp://`` rendezvous would wait inside
C++ for the whole process-group timeout, saying nothing, deaf to a signal, and a shell that still
holds an earlier job's ``SLURM_*`` variables looks exactly like such a task. So the tasks meet
here instead: rank 0 opens the store without waiting for anyone, each other task knocks on its
port until it opens, and every task writes its name and waits for all the others' names in short
turns. Between turns Python runs: a signal handler is heard, and the limit ends the wait with a
line that says who never came, where, and what to do.

Once all have met, the store is the one the process group starts from, as the ``tcp://``
rendezvous would have made it (a multi-tenant ``TCPStore`` hosted by rank 0).
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as torch_dist

from scaleloop.errors import UsageError
from scaleloop.runtime.slurm import SlurmTask

#: How often a waiting task looks again (seconds): short against any limit, cheap for the store.
POLL_S = 0.05
_JOINED = "scaleloop/srun-joined/"


class MeetTimeout(UsageError):
    """Not every task of the step reached the rendezvous in time; the message says who and where."""

    def __init__(self, message: str, task: SlurmTask) -> None:
        super().__init__(message)
        self.task = task


def meet(task: SlurmTask, limit_s: float, group_timeout: timedelta) -> torch_dist.TCPStore:
    """Rank 0's store once every task of ``task``'s step has joined it, within ``limit_s`` seconds.

    The store then waits ``group_timeout`` on a key, as the process group's would. Raises
    :class:`MeetTimeout` past the limit, UsageError when rank 0 cannot listen on its port.
    """
    deadline = time.monotonic() + limit_s
    store = _host(task) if task.rank == 0 else _join(task, deadline, limit_s)
    store.set(f"{_JOINED}{task.rank}", "1")
    names = [f"{_JOINED}{rank}" for rank in range(task.world_size)]
    while not store.check(names):
        if time.monotonic() >= deadline:
            missing = [rank for rank, name in enumerate(names) if not store.check([name])]
            raise MeetTimeout(f"{_ranks(missing)} of {_step(task)} did not join the rendezvous at {task.rendezvous} "
                              f"in {limit_s:g} s (this process is rank {task.rank} of {task.world_size})", task)
        time.sleep(POLL_S)
    store.set_timeout(group_timeout)
    return store


def _host(task: SlurmTask) -> torch_dist.TCPStore:
    """Rank 0's store, listening at once; the others are waited for by :func:`meet`."""
    try:
        return torch_dist.TCPStore(task.master_addr, task.master_port, task.world_size, is_master=True,
                                   timeout=timedelta(seconds=60), wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as exc:   # DistNetworkError is a RuntimeError
        raise UsageError(f"rank 0 of {_step(task)} cannot listen at {task.rendezvous} ({_first_line(exc)}): "
                         "another job step may hold the port; export MASTER_PORT=<a free port> for every task") from None


def _join(task: SlurmTask, deadline: float, limit_s: float) -> torch_dist.TCPStore:
    """A client of rank 0's store, once its port accepts a connection. The port is knocked on with a
    plain socket first: torch's own client logs every refused try, and waits in C++."""
    last = "nothing listens there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MeetTimeout(f"rank 0 of {_step(task)} did not answer at {task.rendezvous} in {limit_s:g} s "
                              f"({last}; this process is rank {task.rank} of {task.world_size})", task)
        try:
            with socket.create_connection((task.master_addr, task.master_port), timeout=min(1.0, left)):
                break
        except OSError as exc:
            last = exc.strerror or str(exc) or last
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    try:
        return torch_dist.TCPStore(task.master_addr, task.master_port, task.world_size, is_master=False,
                                   timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, OSError) as exc:
        raise MeetTimeout(f"{task.rendezvous} answered, but not as rank 0's store of {_step(task)} "
                          f"({_first_line(exc)}; this process is rank {task.rank} of {task.world_size})", task) from None


def _step(task: SlurmTask) -> str:
    return f"SLURM job {task.job or '?'}, step {task.step or '?'}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"ranks {shown}"
