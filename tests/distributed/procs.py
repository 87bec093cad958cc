"""Run scaleloop (and torchrun) in child processes, and never leave one behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

SRC = Path(__file__).resolve().parents[2] / "src"


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], *, cwd: Path, timeout: float = 240, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout or error kill the whole group."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    kill_group(proc)  # torchrun's workers, should any outlive it
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def scaleloop(args: Sequence[str], *, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m scaleloop <args>``; asserts success with the output in the message."""
    res = run([sys.executable, "-m", "scaleloop", *args], cwd=cwd, timeout=timeout)
    assert res.returncode == 0, f"scaleloop {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res
