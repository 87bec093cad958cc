"""Run scaleloop (and torchrun) in child processes, and never leave one behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional, Sequence

SRC = Path(__file__).resolve().parents[2] / "src"

# Every process a test starts carries this mark in its environment, and so do the processes
# they start in turn (torchrun's workers run in sessions of their own, and outlive a killed
# torchrun): it is how the tests find, and end, exactly the processes they started.
OWNER_VAR = "SCALELOOP_TEST_OWNER"
OWNER = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    env[OWNER_VAR] = OWNER
    return env


def owned_pids() -> list[int]:
    """Live processes started (directly or not) by this test session."""
    mark = f"{OWNER_VAR}={OWNER}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_owned() -> None:
    """SIGKILL every process this test session started that is still alive."""
    for pid in owned_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


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
    """End ``proc``, its process group, and every other process this session started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    kill_owned()
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def scaleloop(args: Sequence[str], *, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m scaleloop <args>``; asserts success with the output in the message."""
    res = run([sys.executable, "-m", "scaleloop", *args], cwd=cwd, timeout=timeout)
    assert res.returncode == 0, f"scaleloop {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res
