"""The agent (torchrun with scaleloop's logging): workers forked from it start as fresh ones would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaleloop.launching.agent import FORK_VAR, forks_workers
from scaleloop.launching.torchrun import WORKER_MODULE
from scaleloop.runtime.devices import gpus_present

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def parsed(script: str = WORKER_MODULE, **extra: object) -> SimpleNamespace:
    return SimpleNamespace(**{"module": True, "no_python": False, "run_path": False, "training_script": script,
                              **extra})


@pytest.mark.skipif(not sys.platform.startswith("linux") or gpus_present(), reason="forks only on Linux without GPUs")
def test_scaleloops_own_workers_are_forked_unless_turned_off() -> None:
    assert forks_workers(parsed(), {})
    assert not forks_workers(parsed(), {FORK_VAR: "0"})
    assert not forks_workers(parsed("train.py", module=False), {})     # a user's script: as torchrun starts it
    assert not forks_workers(parsed(no_python=True), {})


def agent(tmp_path: Path, *worker_args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "scaleloop.launching.agent", str(tmp_path / "torchrun.log"), "--nproc-per-node=2",
           "--nnodes=1", "--standalone", f"--log-dir={tmp_path / 'elastic'}", "-m", WORKER_MODULE, str(logs),
           "agent_probe", str(tmp_path), *worker_args]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), **env}
    full.pop("OMP_NUM_THREADS", None)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=120, start_new_session=True)


@pytest.mark.distributed
@pytest.mark.parametrize("fork", ["1", "0"])
def test_forked_and_fresh_workers_start_alike(tmp_path: Path, fork: str) -> None:
    res = agent(tmp_path, env={FORK_VAR: fork})
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "torchrun.log").read_text()
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    agent_pid = facts[0]["ppid"]
    for fact in facts:
        assert fact["ppid"] == agent_pid and fact["world"] == 2
        assert fact["sid"] == fact["pid"]           # a session of its own, as torchrun gives its workers
        assert fact["threads"] == 1                 # torchrun's OMP_NUM_THREADS=1 for several workers
        assert fact["collecting"] and fact["sigterm_default"]
        assert ("scaleloop.launching.agent" in fact["cmdline"]) == (fork == "1")   # forked, or started fresh
    assert "rank 0 says hello" in res.stdout and "rank 1 says hello" not in res.stdout   # rank 1: its log
    assert "rank 1 says hello" in (tmp_path / "logs" / "rank-1.log").read_text()


@pytest.mark.distributed
def test_a_forked_workers_exit_code_is_torchruns_failure(tmp_path: Path) -> None:
    res = agent(tmp_path, "3", env={FORK_VAR: "1"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "exitcode  : 3" in (tmp_path / "torchrun.log").read_text()
