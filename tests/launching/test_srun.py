"""What an srun task says while it waits for the others (scaleloop.launching.srun); the runs are in
tests/distributed/test_slurm_dist.py."""
from __future__ import annotations

import os
import signal

import pytest

from scaleloop.errors import UsageError
from scaleloop.launching import srun
from scaleloop.runtime.preempt import Preempted
from scaleloop.runtime.slurm import task_from_env

LEFT = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
        "SLURM_NODELIST": "localhost", "SLURM_LOCALID": "1"}


def test_the_first_line_says_what_was_read_and_how_long_it_waits() -> None:
    assert srun.first_line(task_from_env(LEFT), 1800) == (
        "srun task: rank 1 of 2 of SLURM job 1, step 0, rendezvous at localhost:15001 (read from SLURM_PROCID, "
        "SLURM_NTASKS, SLURM_JOB_ID, SLURM_STEP_ID, SLURM_LOCALID, SLURM_NODELIST); waiting up to 1800 s "
        "(--timeout) for the other task")
    assert srun.first_line(task_from_env({**LEFT, "SLURM_NTASKS": "4"}), 2.5).endswith(
        "waiting up to 2.5 s (--timeout) for the other 3 tasks")


def test_nproc_ignores_the_variables_and_removes_them() -> None:
    environ = {**LEFT, "HOME": "/root"}
    line = srun.ignored_line(task_from_env(environ), environ, "2")
    assert line == ("note: ignoring SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_JOB_ID=1, SLURM_STEP_ID=0, SLURM_LOCALID=1, "
                    "SLURM_NODELIST=localhost (an srun task's variables: rank 1 of 2 of SLURM job 1, step 0; "
                    "--nproc 2 decides)")
    assert environ == {"HOME": "/root"}


def test_giving_up_says_what_to_do() -> None:
    said = str(srun.gave_up(UsageError("rank 0 did not answer"), task_from_env(LEFT)))
    assert said.startswith("rank 0 did not answer: if no srun started this process")
    assert "run `unset SLURM_PROCID SLURM_NTASKS SLURM_JOB_ID SLURM_STEP_ID SLURM_LOCALID SLURM_NODELIST` first, " \
           "or give --nproc N to start N workers here" in said


def test_sigterm_while_waiting_is_one_line_and_the_handler_is_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as caught:
        with srun.stops_said(task_from_env(LEFT)):
            os.kill(os.getpid(), signal.SIGTERM)   # its handler runs as the call returns
    assert str(caught.value) == ("stopped by SIGTERM while waiting for the other tasks of SLURM job 1, step 0 at "
                                 "localhost:15001 (this process is rank 1 of 2); nothing was trained")
    assert signal.getsignal(signal.SIGTERM) is before
