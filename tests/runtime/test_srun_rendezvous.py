"""srun tasks meet at rank 0's store within a limit, and say who never came (scaleloop.runtime.srun_rendezvous).

Two tasks of one "step" as two threads of this process, on a free loopback port: no process group
is made, only the store both would start it from.
"""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest

from scaleloop.errors import UsageError
from scaleloop.runtime.slurm import SlurmTask
from scaleloop.runtime.srun_rendezvous import MeetTimeout, meet

LONG = timedelta(seconds=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def task(rank: int, port: int, world_size: int = 2) -> SlurmTask:
    return SlurmTask(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                     master_addr="127.0.0.1", master_port=port, job="42", step="3")


def test_the_tasks_meet_and_share_rank_0s_store() -> None:
    port = free_port()
    stores: dict[int, object] = {}
    joiner = threading.Thread(target=lambda: stores.__setitem__(1, meet(task(1, port), 30, LONG)))
    joiner.start()
    stores[0] = meet(task(0, port), 30, LONG)
    joiner.join(timeout=60)
    assert not joiner.is_alive() and set(stores) == {0, 1}
    stores[1].set("from-1", "hello")
    assert stores[0].get("from-1") == b"hello"


def test_nobody_at_rank_0s_port_ends_in_one_line() -> None:
    port = free_port()
    with pytest.raises(MeetTimeout) as caught:
        meet(task(1, port), 0.3, LONG)
    assert str(caught.value) == (f"rank 0 of SLURM job 42, step 3 did not answer at 127.0.0.1:{port} in 0.3 s "
                                 "(Connection refused; this process is rank 1 of 2)")


def test_rank_0_names_the_tasks_that_never_came() -> None:
    with pytest.raises(MeetTimeout) as caught:
        meet(task(0, free_port(), world_size=3), 0.3, LONG)
    assert "ranks 1, 2 of SLURM job 42, step 3 did not join the rendezvous at 127.0.0.1:" in str(caught.value)
    assert str(caught.value).endswith("in 0.3 s (this process is rank 0 of 3)")


def test_a_port_in_use_is_one_line_that_says_what_to_do() -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^rank 0 of SLURM job 42, step 3 cannot listen at 127.0.0.1:{port} "
                                             r"\(.*\): .*export MASTER_PORT=<a free port> for every task$"):
            meet(task(0, port), 5, LONG)
