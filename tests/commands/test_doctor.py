"""``scaleloop doctor``: the story of a run directory, from real runs and from launchers' failure records.

Runs that finish and runs that are interrupted are real (one process, in this process); failed and
stalled multi-process runs are read in tests/distributed/test_failures_dist.py, and here from
failure records as the launcher writes them.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from scaleloop.cli import main
from scaleloop.commands.doctor import diagnose

SMALL = ["--epochs", "1", "--batch-size", "64", "--no-progress", "--device", "cpu", "--checkpoint-every", "4"]

STOPS = '''
from torch import nn

class Stops(nn.Module):
    """The digits MLP, interrupted (as by Ctrl-C) at its 11th forward: after step 10."""
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 11:
            raise KeyboardInterrupt
        return self.net(x)

def build(**_):
    return Stops()
'''


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("doctor") / "finished"
    assert main(["train", *SMALL, "--max-steps", "6", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("doctor-int")
    (root / "stopsmodel.py").write_text(STOPS)
    out = root / "interrupted"
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    try:
        assert main(["train", *SMALL, "--model", "stopsmodel:build", "--out", str(out)]) == 130
    finally:
        mp.undo()
    return out


def test_finished_run(finished: Path, capsys) -> None:
    d = diagnose(finished)
    assert d.state == "finished"
    assert d.what.startswith("finished: 1 epoch(s), 6 step(s), train loss ")
    assert d.checkpoint is not None and d.checkpoint.step == 6
    assert main(["doctor", str(finished)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("what happened: finished")
    assert out[-1] == f"to continue: nothing left to train; to train further: scaleloop train --out {finished} --max-steps 12"
    assert len(out) <= 6


def test_interrupted_run_names_its_step_checkpoint_and_command(interrupted: Path) -> None:
    d = diagnose(interrupted)
    assert d.state in ("interrupted", "stopped")
    assert "step 10" in d.what or "step 8" in d.what, d.what
    assert d.checkpoint is not None and d.checkpoint.step == 8   # --checkpoint-every 4: steps 4 and 8
    assert d.continue_with == f"scaleloop train --out {interrupted}"
    text = "\n".join(d.lines())
    assert "newest valid checkpoint: " in text and "step-00000008 (step 8: epoch 1, step 8)" in text


def test_damaged_newest_checkpoint_is_skipped(interrupted: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(interrupted, copy)
    state = copy / "checkpoints" / "step-00000008" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    d = diagnose(copy)
    assert d.checkpoint is not None and d.checkpoint.step == 4
    assert any("skipping a bad checkpoint" in w for w in d.warnings)


def _record(run: Path, **fields) -> None:
    record = {"kind": "failed", "rank": None, "epoch": None, "step": None, "error_type": None, "message": "",
              "frame": None, "waiting_in": None, "logs": {}, "time": "2026-11-25T10:00:00", "report": []}
    record.update(fields)
    (run / "failure.json").write_text(json.dumps(record))


def test_failed_run_from_the_launchers_record(interrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    _record(run, rank=1, epoch=1, step=3, error_type="ValueError", message="bad batch",
            frame="/home/u/model.py:12 in forward", logs={"0": "logs/rank-0.log", "1": "logs/rank-1.log"})
    d = diagnose(run)
    assert d.state == "failed"
    assert d.what == "failed on rank 1 at epoch 1, step 3 with ValueError: bad batch"
    assert "raised at /home/u/model.py:12 in forward" in d.details
    assert f"log of rank 1: {run / 'logs/rank-1.log'} (all ranks: 2 logs beside it)" in d.details
    assert d.continue_with == f"scaleloop train --out {run}"


def test_stalled_run_from_the_launchers_record(interrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    _record(run, kind="stalled", rank=1, epoch=1, step=9, frame="/home/u/model.py:20 in forward",
            waiting_in="gradient all-reduce in backward (DDP)")
    d = diagnose(run)
    assert d.state == "stalled"
    assert d.what == "stalled: rank 1 stopped taking part at epoch 1, step 9, stuck at /home/u/model.py:20 in forward"
    assert "the other ranks waited in gradient all-reduce in backward (DDP)" in d.details


def test_a_run_finished_after_an_old_failure_is_finished(finished: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _record(run, rank=0, error_type="RuntimeError", message="old")
    old = time.time() - 3600
    os.utime(run / "failure.json", (old, old))
    assert diagnose(run).state == "finished"


def test_no_checkpoint_says_to_start_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('model = "simplenet"\n')
    d = diagnose(run)
    assert d.state == "not started"
    # nothing kept: the corrected command may reuse the directory (output.rundir.prepare_run_dir)
    assert d.continue_with == "nothing was kept (no checkpoint, no logged step): run the same command again, once fixed"
    (run / "metrics.csv").write_text("kind,epoch,step,samples\nstep,1,1,64\n")   # a step trained, no checkpoint
    d = diagnose(run)
    assert d.continue_with.startswith("no checkpoint to continue from; start over: scaleloop train --config ")
    assert d.continue_with.endswith(f"--out {run}-2")


def test_not_a_run_directory_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a scaleloop run directory" in err[0]
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def _lock(run: Path, pid: int, start: "str | None", host: str) -> None:
    (run / "scaleloop.lock").write_text(json.dumps({"host": host, "pid": pid, "since": time.time(), "start": start}))


def test_a_run_whose_lock_is_held_by_a_live_process_is_running(interrupted: Path, tmp_path: Path) -> None:
    """Issue 41.4: a lock held by a live process (this one, its start time as recorded) is a run in
    progress: "running (pid, ranks, step N)" and no continue command, whatever an earlier attempt left."""
    import socket

    from scaleloop.output.lock import _start_time

    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    _record(run, kind="interrupted", message="Ctrl-C (SIGINT) or SIGTERM")
    _lock(run, os.getpid(), _start_time(os.getpid()), socket.gethostname())
    d = diagnose(run)
    assert d.state == "running" and d.continue_with is None
    assert d.what == f"running (pid {os.getpid()}, 1 rank, step 10)", d.what
    assert d.lines()[-1] == "to continue: nothing to continue: the run is still going"
    # The same pid with another start time is another process (the pid was reused): not the run.
    _lock(run, os.getpid(), "1", socket.gethostname())
    assert diagnose(run).state == "interrupted"


def test_torchruns_own_failure_is_read_without_a_rank(interrupted: Path, tmp_path: Path) -> None:
    """Issue 41.6: no worker started (a port in use): doctor says what torchrun said, and points to its
    log, not to rank logs that do not exist."""
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    line = "port 29517 is already in use, so torchrun could not start the workers' rendezvous there; " \
           "choose a free port with --master-port"
    _record(run, message=line)
    (run / "logs").mkdir(exist_ok=True)
    (run / "logs" / "torchrun.log").write_text("...\n")
    d = diagnose(run)
    assert d.what == f"failed: {line}"
    assert d.details[0] == f"torchrun's messages: {run / 'logs' / 'torchrun.log'}"


def test_a_replica_groups_job_is_told_group_by_group(finished: Path, interrupted: Path, tmp_path: Path,
                                                    capsys) -> None:
    """``scaleloop train --replica-groups 2 --out job``'s directory: group-0 finished, group-1 got over a
    fault (recovery.json) and then failed; the job continues with the one-machine command."""
    job = tmp_path / "job"
    shutil.copytree(finished, job / "group-0")
    shutil.copytree(interrupted, job / "group-1")
    _record(job / "group-1", rank=0, epoch=1, step=9, error_type="ValueError", message="bad batch")
    (job / "group-1" / "recovery.json").write_text(json.dumps([{"when": "2026-12-06T10:00:00", "summary": (
        "rank 0 of 1 was killed by SIGKILL; replica group 1 left after step 2 and rejoined at step 5")}]))
    (job / "lighthouse.log").write_text("")
    assert main(["doctor", str(job)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"replica groups: {job} (2 groups)"
    assert out[1].startswith("group-0: finished: 1 epoch(s), 6 step(s)"), out
    group1 = out.index("group-1: failed on rank 0 at epoch 1, step 9 with ValueError: bad batch; on the way torchrun "
                       "restarted its workers 1 time(s) after a fault (below)")
    assert ("  2026-12-06T10:00:00: rank 0 of 1 was killed by SIGKILL; replica group 1 left after step 2 and rejoined "
            "at step 5") in out[group1:]
    assert f"  newest valid checkpoint: {job / 'group-1' / 'checkpoints' / 'step-00000008'} (step 8)" in out[group1:]
    assert out[-2:] == [f"the lighthouse's messages: {job / 'lighthouse.log'}",
                        f"to continue: scaleloop train --replica-groups 2 --nproc 2 --out {job}"]
