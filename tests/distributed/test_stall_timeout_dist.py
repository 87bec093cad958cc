"""Every process group a strategy makes honours ``--timeout``: a rank stopped outright.

Under each strategy (ddp, allreduce, fsdp, pipeline, and ``--mesh dp=2,tp=2`` on 4 processes),
rank 1 is stopped with SIGSTOP once the run's first checkpoint is written: it neither fails nor
answers. The others must give up after ``--timeout`` in whichever group they wait (the default
group, FSDP's agreement group, a mesh dimension's), and the run end with the stall report naming
rank 1, its checkpoint intact. Before each group took the timeout, fsdp and the mesh waited out
torch's 30-minute default.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from procs import child_env, kill_group
from scaleloop.checkpoint.store import locate, verify_checkpoint

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10
# Issue 41.1: the run ends within --timeout plus this. Once a worker failed, torchrun's agent sends
# the others SIGTERM and would wait 30 s more for a stopped rank, which cannot act on it (SIGKILL
# after a wait fixed in torch 2.13's LocalElasticAgent._stop_workers); the launcher continues a
# stopped worker that is told to end (launching.supervisor.continue_stopped_workers).
SLACK_S = 30
CHECKPOINT_EVERY = 5
STOPPED = 1

BASE = ["--no-progress", "--no-tensorboard", "--epochs", "100", "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--timeout", str(TIMEOUT_S)]
LAYOUTS = {
    "ddp": ["--strategy", "ddp", "--nproc", "2"],
    "allreduce": ["--strategy", "allreduce", "--nproc", "2"],
    "fsdp": ["--strategy", "fsdp", "--nproc", "2"],
    "pipeline": ["--strategy", "pipeline", "--nproc", "2"],
    "mesh": ["--mesh", "dp=2,tp=2", "--nproc", "4", "--model", "tinygpt", "--data", "tokens", "--n-samples", "2000",
             "--seq-len", "8", "--vocab-size", "32"],
}


def wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def pid_of_rank(out: Path, rank: int) -> int:
    """The worker's pid, from the first line of its log (``==== scaleloop worker rank R, ..., pid P``)."""
    found = re.search(r"pid (\d+)", (out / "logs" / f"rank-{rank}.log").read_text())
    assert found is not None
    return int(found.group(1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_stopped_rank_ends_the_run_within_the_timeout(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "scaleloop", "train", *BASE, *LAYOUTS[layout], "--out", str(out)],
                            cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stopped = None
    try:
        wait_for(lambda: (out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}").is_dir(), "first checkpoint", proc)
        stopped = pid_of_rank(out, STOPPED)
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        _, err = proc.communicate(timeout=TIMEOUT_S + SLACK_S + 30)   # (the bound is asserted below)
        took = time.monotonic() - since
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        kill_group(proc)
    assert proc.returncode == 1, err
    report = err[err.index("scaleloop: error:"):].splitlines()
    assert re.match(rf"scaleloop: error: the run stalled at epoch \d+, step \d+: rank {STOPPED} stopped taking part; "
                    rf"ranks? [\d, and]+ gave up waiting after {TIMEOUT_S} s \(--timeout\)$", report[0]), report
    assert took < TIMEOUT_S + SLACK_S, f"{took:.1f} s"
    saved = json.loads((out / "failure.json").read_text())
    assert saved["kind"] == "stalled" and saved["rank"] == STOPPED, saved
    assert verify_checkpoint(locate(out)).step >= CHECKPOINT_EVERY
