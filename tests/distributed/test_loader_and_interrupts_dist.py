"""DataLoader workers that fail, and interrupts that reach the workers (issue 51, points 6-7).

- A worker process whose dataset raises (``scripts/loader_faults.py``, sample 77), under
  ``--nproc 2``: the report names the rank, the user's own line and the sample, exit 1, and
  doctor reads the same from ``failure.json``.
- A worker process SIGKILLed (as the out-of-memory killer does): "killed by signal SIGKILL" with
  the likely cause, no traceback on the console (multiprocessing's resource sharer in the other
  worker, which loses its reader as the rank ends, prints none).
- A temporary directory too long for the socket a worker process hands its batches through: one
  line before the first step (torch's worker would fail in a thread that reports nothing, and the
  run would wait forever: this is what hung these tests inside the suite, whose temporary
  directories are 10 characters longer than a lone run's).

- SIGINT that reaches torchrun or a worker but not the command itself (``kill -INT``, or a shell
  that started it with SIGINT ignored): ``verify``, ``bench`` and ``plan`` say "interrupted" and
  exit 130, with no verdict and no temporary directory left, as for a Ctrl-C they hear.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from forked_launch import FORK_LAUNCH_VAR
from procs import SRC, ForkedRun, child_env, kill_group, run

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRAIN = [sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--epochs", "1", "--no-progress",
         "--no-tensorboard", "--num-workers", "1", "--batch-size", "8"]


def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "TMPDIR": str(tmp_path / "tmp"),
                      "HOLD_REACHED": str(tmp_path / "reached")})


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _interrupt_below(cmd: list[str], tmp_path: Path, ready: Callable[[], bool], depth: int,
                     fresh: bool = False) -> tuple[int, str, str]:
    """Start ``cmd``; once ``ready()``, SIGINT its descendants ``depth`` levels down (1: torchrun, or
    a worker started without it; 2: a fork of its agent), never the command itself. The command is a
    fork of the tests' fork server, and so is what it starts (forked_launch.py); ``fresh``: what it
    starts is fresh interpreters, as users' are (SCALELOOP_TEST_FORK_LAUNCH=0)."""
    proc = ForkedRun(cmd, cwd=SCRIPTS, env={**env(tmp_path), **({FORK_LAUNCH_VAR: "0"} if fresh else {})},
                     timeout=300)
    try:
        deadline = time.monotonic() + 180
        while not ready():
            assert proc.poll() is None, f"ended ({proc.returncode}) before it could be interrupted"
            assert time.monotonic() < deadline, "not ready to interrupt within 180 s"
            time.sleep(0.02)
        level = [proc.pid]
        for _ in range(depth):
            level = [child for pid in level for child in _children(pid)]
        assert level, "nothing to interrupt"
        for pid in level:
            os.kill(pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


def check_interrupted(code: int, out: str, err: str, tmp_path: Path) -> None:
    assert code == 130, out + err
    assert [line for line in err.splitlines() if line.strip() and not line.startswith("bench: ")] == [
        "scaleloop: interrupted"], out + err
    assert "verdict" not in out and "FAIL" not in out + err
    assert not list((tmp_path / "tmp").glob("scaleloop-*")), list((tmp_path / "tmp").iterdir())


def test_verify_interrupted_in_its_workers_says_so(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scaleloop", "verify", "--steps", "3", "--model", "held_workers:held"]
    check_interrupted(*_interrupt_below(cmd, tmp_path, (tmp_path / "reached").exists, 1, fresh=True), tmp_path)


def test_bench_interrupted_in_its_workers_says_so(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scaleloop", "bench", "scaling", "--quick", "--device", "cpu", "--workers", "1,2",
           "--model", "held_workers:held", "--data", "digits", "--out", str(tmp_path / "out")]
    check_interrupted(*_interrupt_below(cmd, tmp_path, (tmp_path / "reached").exists, 1), tmp_path)


def test_plan_interrupted_in_its_worker_says_so(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scaleloop", "plan", "--gpus", "8", "--gpu", "h100", "--measure-host"]
    started = lambda: any((tmp_path / "tmp").glob("scaleloop-launch-*/logs/rank-0.log"))  # noqa: E731
    check_interrupted(*_interrupt_below(cmd, tmp_path, started, 2), tmp_path)


def _train(tmp_path: Path, data: str, nproc: str, tmpdir: Path) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "run"
    cmd = [*TRAIN, "--data", f"loader_faults:{data}", "--nproc", nproc, "--num-workers", "2" if nproc == "1" else "1",
           "--out", str(out)]
    # A fork of the tests' fork server, as are the other runs of the suite (procs.run): TMPDIR is
    # read again in the fork, as in a fresh interpreter (forkserver._become).
    res = run(cmd, cwd=SCRIPTS, env={**env(tmp_path), "TMPDIR": str(tmpdir)}, timeout=180)
    return res, out


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory whose sockets fit (see the module docstring), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_temporary_directory_too_long_for_the_workers_sockets_is_refused_in_one_line(tmp_path: Path) -> None:
    long = tmp_path / ("t" * 80)
    long.mkdir()
    res, out = _train(tmp_path, "raises", "1", long)
    assert res.returncode == 2, res.stdout + res.stderr
    [said] = [line for line in res.stderr.splitlines() if line.strip()]
    assert said == (f"scaleloop: error: DataLoader worker processes (--num-workers) cannot pass batches through a socket "
                    f"in the temporary directory {long} ({len(str(long))} characters; at most 75 fit): set TMPDIR to "
                    f"a shorter path, or use --num-workers 0"), said


def test_a_raising_loader_worker_names_the_rank_the_users_line_and_the_sample(tmp_path: Path, short_tmp: Path) -> None:
    res, out = _train(tmp_path, "raises", "2", short_tmp)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    first = next(line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:"))
    assert ": ValueError: cannot decode record 77 (in DataLoader worker process 0, reading sample 77)" in first, first
    assert first.startswith("scaleloop: error: rank ") and " of 2 failed" in first
    assert "raised at: " in res.stderr and "loader_faults.py" in res.stderr and "in fail" in res.stderr
    doctor = subprocess.run([sys.executable, "-m", "scaleloop", "doctor", str(out)], env=env(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert "with ValueError: cannot decode record 77 (in DataLoader worker process 0, reading sample 77)" in doctor.stdout


def test_a_sigkilled_loader_worker_is_said_with_its_signal_and_likely_cause(tmp_path: Path, short_tmp: Path) -> None:
    res, out = _train(tmp_path, "killed", "1", short_tmp)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    assert "was killed by signal SIGKILL: most often the kernel's out-of-memory killer" in res.stderr, res.stderr
    assert '"kind": "failed"' in (out / "failure.json").read_text()

