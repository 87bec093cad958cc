"""A run directory on a full disk ends in one line, exit 2 and a record that doctor reads as
``unwritable``, however the disk fills (issue 51, points 4 and 5), on a real small tmpfs:

- no room for the run directory's lock: the launcher's one line, not a traceback;
- the disk fills while 2 ranks run (a checkpoint takes the last bytes, and the ranks' logs and
  error records find no room either): not "rank 0 exited with code 2 and no Python error";
- TensorBoard's writer thread fills it (``--log-every 1``, no checkpoints), on 1 and 2 processes:
  not the writer's traceback, and no 0-byte ``*.tmp-*`` records left behind.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import run
from scaleloop.commands.doctor import diagnose

pytestmark = pytest.mark.distributed

TRAIN = [sys.executable, "-m", "scaleloop", "train", "--data", "random", "--no-progress"]


def shrink(disk: Path, size: str, leave_kb: int) -> None:
    """Make ``disk`` a ``size`` tmpfs with ``leave_kb`` KB free: a file takes the rest."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with open(disk / "filler", "r+b") as f:   # give back what the run may have
        f.truncate(max(0, (disk / "filler").stat().st_size - leave_kb * 1024))


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (res.stdout + res.stderr).splitlines()
            if "error" in line.lower() or "Traceback" in line or "Exception" in line]


def leftovers(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if ".tmp" in p.name]


def check_unwritable(res: subprocess.CompletedProcess, run_dir: Path) -> None:
    said = error_lines(res)
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(said) == 1 and said[0].startswith("scaleloop: error: cannot write ") and "disk full" in said[0], (
        res.stdout + res.stderr)
    record = json.loads((run_dir / "failure.json").read_text())
    assert record["kind"] == "unwritable" and "disk full" in record["message"], record
    told = diagnose(run_dir)
    assert told.state == "unwritable" and "disk full" in told.what, told.what
    assert not leftovers(run_dir), leftovers(run_dir)


def test_no_room_for_the_lock_is_one_line(small_disk: Path) -> None:
    shrink(small_disk, "256k", 0)
    run_dir = small_disk / "run"
    res = run([*TRAIN, "--nproc", "2", "--max-steps", "3", "--out", str(run_dir)], cwd=small_disk.parent, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.fullmatch(rf"scaleloop: error: cannot write '{run_dir}/scaleloop.lock': disk full \(it needs \d+ bytes, "
                        r"0 bytes free\); once space is freed, run the same command again\n", res.stderr), res.stderr
    assert not (run_dir / "scaleloop.lock").exists()   # a later run is not told the directory is in use


def test_a_disk_that_fills_under_two_ranks_is_unwritable(small_disk: Path) -> None:
    # The checkpoint of step 5 takes the last bytes; the ranks' logs, error records and the launcher's
    # usage-error files get none.
    shrink(small_disk, "300k", 28)
    run_dir = small_disk / "run"
    res = run([*TRAIN, "--nproc", "2", "--max-steps", "8", "--checkpoint-every", "5", "--no-tensorboard",
               "--out", str(run_dir)], cwd=small_disk.parent, timeout=240)
    check_unwritable(res, run_dir)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_disk_filled_by_tensorboard_is_unwritable(small_disk: Path, nproc: int) -> None:
    shrink(small_disk, "256k", 96)
    run_dir = small_disk / "run"
    res = run([*TRAIN, "--nproc", str(nproc), "--no-checkpoints", "--log-every", "1", "--epochs", "100",
               "--out", str(run_dir)], cwd=small_disk.parent, timeout=240)
    check_unwritable(res, run_dir)
