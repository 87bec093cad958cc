"""Every ending recorded and read right by ``scaleloop doctor``, on real 2-process runs (issue 41.4, 6, 9).

- a live run: doctor says "running (pid, ranks, step N)" and gives no continue command; then a
  closed terminal (SIGHUP to the launcher's process group) stops it with a checkpoint and a
  record that doctor reads as "terminal closed (SIGHUP)";
- rank 1 killed (SIGKILL) under ``--max-restarts 2``: the console says which rank died, how, the
  restart's number and the recovery time; ``recovery.json`` holds it and doctor says so;
- ``--master-port`` taken by another process: one line naming the port, "already in use" and the
  flag, and no pointer to logs that do not exist.

The runs are held at a known point by ``slow_models:held`` (rank 0 waits at its 8th training
forward for a file the test creates).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Callable

import pytest

from forked_launch import FORK_LAUNCH_VAR
from procs import SRC, ForkedRun, child_env, kill_group, run
from scaleloop.commands.doctor import diagnose

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRAIN = [sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--no-progress", "--no-tensorboard",
         "--checkpoint-every", "5"]
HELD_AT = 8   # = slow_models.HELD_AT


def env(tmp_path: Path) -> dict[str, str]:
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]),
                      "HOLD_REACHED": str(tmp_path / "reached"), "HOLD_RELEASE": str(tmp_path / "release")})


def start(cmd: list[str], tmp_path: Path, fresh: bool = False) -> ForkedRun:
    """``cmd`` to be watched and signalled: the launcher a fork of the tests' fork server (its own
    session, as a terminal's job), and so are torchrun's agent and its workers (forked_launch.py);
    ``fresh``: the agent and the workers it starts and restarts are fresh interpreters, as users'
    are (SCALELOOP_TEST_FORK_LAUNCH=0)."""
    return ForkedRun(cmd, cwd=SCRIPTS, env={**env(tmp_path), **({FORK_LAUNCH_VAR: "0"} if fresh else {})},
                     timeout=300)


def wait_for(condition: Callable[[], bool], proc: ForkedRun, what: str, timeout: float = 240) -> None:
    """Wait for a file the run writes (polling it: the run is another process)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def test_doctor_knows_a_live_run_and_a_closed_terminal_stops_it_with_a_record(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start([*TRAIN, "--model", "slow_models:held", "--epochs", "100", "--out", str(out)], tmp_path)
    try:
        wait_for((tmp_path / "reached").exists, proc, f"step {HELD_AT}")
        told = diagnose(out)
        assert told.state == "running" and told.continue_with is None, told
        # The launcher holds the lock; the newest of the checkpoint (step 5) and the last logged step.
        assert re.fullmatch(rf"running \(pid {proc.pid}, 2 ranks, step [5-7]\)", told.what), told.what
        assert told.lines()[-1] == "to continue: nothing to continue: the run is still going"
        os.killpg(proc.pid, signal.SIGHUP)   # as a closing terminal does to its foreground group
        (tmp_path / "release").touch()
        _, err = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, err
    said = [line for line in err.splitlines() if line.strip()]
    assert len(said) == 1 and re.fullmatch(
        rf"scaleloop: stopped by SIGHUP \(terminal closed\) after step (\d+); checkpoint {out}/checkpoints/"
        rf"step-0*\1 written; continue with: scaleloop train --out {out}", said[0]), err
    record = json.loads((out / "failure.json").read_text())
    assert record["kind"] == "stopped" and "SIGHUP (terminal closed)" in record["message"], record
    told = diagnose(out)
    assert told.state == "stopped" and told.what == said[0].removeprefix("scaleloop: "), told.what
    assert told.continue_with == f"scaleloop train --out {out}"


def test_a_restart_after_a_killed_rank_is_said_recorded_and_read(tmp_path: Path) -> None:
    """Rank 1 is killed while rank 0 waits in its own forward: torchrun stops rank 0 before any
    collective fails, so no process leaves a record of the fault (on main: no word of it at all)."""
    out = tmp_path / "run"
    proc = start([*TRAIN, "--model", "slow_models:held", "--max-steps", "12", "--max-restarts", "2",
                  "--out", str(out)], tmp_path, fresh=True)
    try:
        wait_for((tmp_path / "reached").exists, proc, f"step {HELD_AT}")
        rank1 = int(re.search(r"pid (\d+)", (out / "logs" / "rank-1.log").read_text()).group(1))
        os.kill(rank1, signal.SIGKILL)
        wait_for(lambda: "attempt 1" in (out / "logs" / "rank-1.log").read_text(), proc, "the restart")
        (tmp_path / "release").touch()
        stdout, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err
    said = [line for line in stdout.splitlines() if line.startswith("scaleloop: recovered")]
    assert len(said) == 1 and re.match(
        r"scaleloop: recovered \(torchrun's restart 1 of 2\): rank 1 of 2 was killed by SIGKILL .*resumed from "
        r"step 5, first step done [\d.]+ s after that: [\d.]+ s from the last step before the fault to training "
        r"again$", said[0]), stdout
    entry = json.loads((out / "recovery.json").read_text())[-1]
    assert entry["restart"] == 1 and entry["lost_ranks"] == [1] and entry["total_s"] > 0, entry
    told = diagnose(out)
    assert told.state == "finished" and "torchrun restarted its workers 1 time(s) after a fault" in told.what
    assert any("rank 1 of 2 was killed by SIGKILL" in line for line in told.recoveries), told.recoveries


def test_a_port_in_use_is_named_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run([*TRAIN, "--max-steps", "3", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "--out", str(out)], cwd=tmp_path, timeout=180, env=env(tmp_path))
    assert res.returncode == 1, res.stderr
    report = res.stderr[res.stderr.index("scaleloop: error:"):].splitlines()
    line = (f"port {port} is already in use, so torchrun could not start the workers' rendezvous there; "
            "choose a free port with --master-port")
    assert report[0] == f"scaleloop: error: {line}", report
    assert report[1] == f"  torchrun's messages: {out / 'logs' / 'torchrun.log'}"
    assert not any("rank-" in text for text in report), report   # no worker started: no rank logs exist
    told = diagnose(out)
    assert told.what == f"failed: {line}"
    assert all(Path(text.rpartition(": ")[2]).exists() for text in told.details if "messages:" in text)
