"""The agent (torchrun with scaleloop's logging) starts its workers as torchrun does: fresh interpreters."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleloop.launching.torchrun import WORKER_MODULE

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def agent(tmp_path: Path, *worker_args: str) -> subprocess.CompletedProcess:
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "scaleloop.launching.agent", str(tmp_path / "torchrun.log"), "--nproc-per-node=2",
           "--nnodes=1", "--standalone", f"--log-dir={tmp_path / 'elastic'}", "-m", WORKER_MODULE, str(logs),
           "agent_probe", str(tmp_path), *worker_args]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    full.pop("OMP_NUM_THREADS", None)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=120, start_new_session=True)


@pytest.mark.distributed
def test_workers_are_fresh_interpreters_as_under_torchrun(tmp_path: Path) -> None:
    res = agent(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "torchrun.log").read_text()
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    agent_pid = facts[0]["ppid"]
    for fact in facts:
        assert fact["ppid"] == agent_pid and fact["world"] == 2
        assert fact["sid"] == fact["pid"]           # a session of its own, as torchrun gives its workers
        assert fact["threads"] == 1                 # torchrun's OMP_NUM_THREADS=1 for several workers
        assert fact["collecting"] and fact["sigterm_default"]
        assert f"-m\0{WORKER_MODULE}\0" in fact["cmdline"]   # started as `python -u -m scaleloop.launching.worker`
    assert "rank 0 says hello" in res.stdout and "rank 1 says hello" not in res.stdout   # rank 1: its log
    assert "rank 1 says hello" in (tmp_path / "logs" / "rank-1.log").read_text()


@pytest.mark.distributed
def test_a_workers_exit_code_is_torchruns_failure(tmp_path: Path) -> None:
    res = agent(tmp_path, "3")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "exitcode  : 3" in (tmp_path / "torchrun.log").read_text()


LEAVING = """
import logging, sys
from scaleloop.launching.agent import _log_to, leave

_log_to(sys.argv[1])
logging.getLogger("torch.distributed.run").warning("the agent's last line")
sys.stdout.write("written, not yet flushed")
leave(3)
"""


def test_leave_flushes_the_log_and_the_streams_and_exits_with_the_code(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}   # buffered, as by default
    res = subprocess.run([sys.executable, "-c", LEAVING, str(tmp_path / "torchrun.log")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert res.stdout == "written, not yet flushed"
    assert "the agent's last line" in (tmp_path / "torchrun.log").read_text()
