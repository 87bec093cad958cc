"""Workers never outlive their launcher (issue 27 point 1).

``kill -9`` of ``scaleloop train --nproc 2``'s whole process group used to leave torchrun's
workers running (they run in sessions of their own) and writing checkpoints, while the dead
launcher's lock looked stale: a second run on the same ``--out`` then started a second group of
writers. Now each link holds its lifeline to the one before (``scaleloop.launching.lifeline``)
and the lock is not taken over while a writer lives (``scaleloop.output.lock``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from procs import child_env, kill_group, owned_pids, scaleloop

pytestmark = pytest.mark.distributed

FLAGS = ["--nproc", "2", "--data", "digits", "--epochs", "3", "--batch-size", "32", "--checkpoint-every", "5",
         "--device", "cpu", "--no-progress", "--no-tensorboard"]
START_TIMEOUT_S = 180     # torch's imports on a busy machine, the rendezvous, the first steps
GONE_WITHIN_S = 10


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _is_worker(pid: int) -> bool:
    """A worker torchrun started: a child of torchrun (``scaleloop.launching.agent``), started as
    ``python -u -m scaleloop.launching.worker ...``."""
    return "scaleloop.launching.agent" in _cmdline(_parent(pid)) and "scaleloop.launching.worker" in _cmdline(pid)


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, Z, ...), "gone" once it has been reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie writes nothing; its reaping is init's business)."""
    return _state(pid) not in ("Z", "X", "gone")


def _writers_of(run_dir: Path) -> list[int]:
    """This test's processes that name the run directory (the launcher's and torchrun's workers)."""
    return [pid for pid in owned_pids() if str(run_dir) in _cmdline(pid) and _running(pid)]


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for path in run_dir.rglob("*"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        found[str(path.relative_to(run_dir))] = (st.st_mtime_ns, st.st_size)
    return found


def _wait_for(condition, deadline_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher ended ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {deadline_s:.0f} s")
        time.sleep(0.05)


def test_kill_9_of_the_launcher_leaves_no_worker_and_the_retry_resumes_bitwise(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    scaleloop(["train", *FLAGS, "--out", str(whole)], cwd=tmp_path, timeout=300)

    run_dir = tmp_path / "killed"
    with open(tmp_path / "killed.log", "wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "scaleloop", "train", *FLAGS, "--out", str(run_dir)],
                                    cwd=tmp_path, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        _wait_for(lambda: any((run_dir / "checkpoints").glob("step-*/manifest.json")), START_TIMEOUT_S,
                  "checkpoint", launcher)
        workers = [pid for pid in _writers_of(run_dir) if _is_worker(pid)]
        assert len(workers) == 2, f"expected 2 workers running, found {workers}"
        os.killpg(launcher.pid, signal.SIGKILL)   # the launcher, torchrun: its whole process group
        launcher.wait(timeout=30)

        # Their environment is unreadable once they exit: watch the pids themselves as well.
        _wait_for(lambda: not _writers_of(run_dir) and not any(_running(pid) for pid in workers), GONE_WITHIN_S,
                  f"end of every worker ({', '.join(f'{pid}: {_state(pid)}' for pid in workers)})")
        # Nothing writes there any more: the directory stays as it is over many checkpoint intervals.
        before = _snapshot(run_dir)
        window = time.monotonic() + 2.0
        while time.monotonic() < window:
            assert _snapshot(run_dir) == before, "something still writes into the run directory"
            time.sleep(0.1)
    finally:
        kill_group(launcher)
    log_text = (tmp_path / "killed.log").read_text(errors="replace")
    assert "model.pt" not in os.listdir(run_dir), log_text

    resumed = scaleloop(["train", *FLAGS, "--out", str(run_dir)], cwd=tmp_path, timeout=300)
    assert "resuming from" in resumed.stdout, resumed.stdout
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(run_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run's"
