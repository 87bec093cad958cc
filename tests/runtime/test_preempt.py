"""Preemption signals: names, which signals stop a run where, SLURM's requeue, and the vote in one process."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scaleloop.errors import UsageError
from scaleloop.runtime.preempt import signal_name, signal_number, stop_signals
from scaleloop.runtime.slurm import in_slurm_job, requeue

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("name", ["SIGUSR2", "usr2", "USR2", str(int(signal.SIGUSR2))])
def test_signal_names(name: str) -> None:
    assert signal_number(name) == signal.SIGUSR2


@pytest.mark.parametrize("name, says", [("SIGKILL", "cannot be caught"), ("STOP", "cannot be caught"),
                                        ("SIGFOO", "not a signal name"), ("", "not a signal name")])
def test_bad_signal_is_one_clear_line(name: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        signal_number(name)


def test_sigterm_stops_except_a_torchrun_worker_outside_slurm() -> None:
    # torchrun ends the survivors of a failed rank with SIGTERM (and they dump their stacks on it).
    assert stop_signals(None, torchrun_worker=True, slurm=False) == [signal.SIGUSR1]
    assert stop_signals("SIGTERM", torchrun_worker=True, slurm=False) == [signal.SIGUSR1]
    # SLURM signals every process of the job itself; a plain process or the launcher is not torchrun's.
    assert set(stop_signals(None, torchrun_worker=True, slurm=True)) == {signal.SIGUSR1, signal.SIGTERM}
    assert set(stop_signals("USR2", torchrun_worker=False, slurm=False)) == {signal.SIGUSR1, signal.SIGTERM,
                                                                             signal.SIGHUP, signal.SIGUSR2}
    assert in_slurm_job({"SLURM_JOB_ID": "7"}) and not in_slurm_job({})


def test_a_closed_terminal_stops_the_process_it_talks_to_and_is_named() -> None:
    """Issue 41.9: SIGHUP stops the launcher or a one-process run after its step (with a checkpoint
    and a record), named as a closed terminal; a worker (torchrun's or srun's) does not take it."""
    assert signal.SIGHUP in stop_signals(None, torchrun_worker=False, slurm=False)
    assert signal.SIGHUP not in stop_signals(None, torchrun_worker=True, slurm=False)
    assert signal.SIGHUP not in stop_signals(None, torchrun_worker=False, slurm=True)
    assert signal_name(signal.SIGHUP) == "SIGHUP (terminal closed)" and signal_name(signal.SIGTERM) == "SIGTERM"


def test_requeue_calls_scontrol_with_the_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said = tmp_path / "said"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {said}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert requeue({"SLURM_JOB_ID": "4242"}) == "job 4242 requeued (scontrol requeue 4242)"
    assert said.read_text().split() == ["requeue", "4242"]
    fake.write_text("#!/bin/sh\necho 'Requeue of JobId=4242 not allowed' >&2\nexit 1\n")
    assert "failed (Requeue of JobId=4242 not allowed)" in requeue({"SLURM_JOB_ID": "4242"})
    assert "not in a SLURM job" in requeue({})


def test_one_process_stops_on_sigterm_after_the_step() -> None:
    # In a child: the handlers it installs must not stay in the test process.
    code = """
import os, signal, torch
from types import SimpleNamespace
from scaleloop.loop.pauses import StopVote
vote = StopVote(SimpleNamespace(is_distributed=False, device=torch.device('cpu')), None, torchrun_worker=False)
assert not vote.after_step(1)
os.kill(os.getpid(), signal.SIGTERM)   # noted, not fatal
assert vote.after_step(2) and vote.stopped_after == 2
print("alive after SIGTERM")
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("SLURM_JOB_ID", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "alive after SIGTERM" in res.stdout, res.stderr
