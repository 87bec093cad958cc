"""The loop's record of the endings it decides itself (scaleloop.loop.pauses), and what ``scaleloop doctor`` reads from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleloop.commands.doctor import diagnose
from scaleloop.errors import UsageError
from scaleloop.loop.pauses import record_ending
from scaleloop.loop.rows import diverged
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.frames import note_where
from scaleloop.runtime.preempt import Preempted


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('model = "simplenet"\n')
    (run / "metrics.csv").write_text("kind,epoch,step,samples\nstep,1,4,256\n")
    return run


def _where(exc: BaseException, during: str | None = None) -> BaseException:
    note_where(exc, epoch=2, step=7, during=during)
    return exc


@pytest.mark.parametrize("exc, kind, state, what", [
    (diverged("the training loss became nan", 7, 2, None, None, ranks=(1,), world=2), "diverged", "diverged",
     "diverged: the training loss became nan at step 7 (epoch 2) on rank 1"),
    (Preempted("stopped by SIGTERM after step 6; checkpoint X written; continue with: scaleloop train --out X"),
     "stopped", "stopped", "stopped by SIGTERM after step 6; checkpoint X written; continue with: scaleloop train --out X"),
    (_where(RunDirWriteError("cannot write 'm.csv': disk full"), "writing the checkpoint of step 7"),
     "unwritable", "unwritable", "stopped while writing the checkpoint of step 7: cannot write 'm.csv': disk full"),
    (_where(UsageError("the model returned a str, not a tensor")), "usage", "failed",
     "stopped on bad input at epoch 2, step 7: the model returned a str, not a tensor"),
    (KeyboardInterrupt(), "interrupted", "interrupted", "interrupted at step 6 (Ctrl-C (SIGINT) or SIGTERM)"),
], ids=["diverged", "stopped", "unwritable", "usage", "interrupted"])
def test_each_ending_is_recorded_and_read_back(tmp_path: Path, exc: BaseException, kind: str, state: str,
                                               what: str) -> None:
    run = _run_dir(tmp_path)
    record_ending(run, exc, step=6)
    saved = json.loads((run / "failure.json").read_text())
    assert saved["kind"] == kind and saved["error_type"] == type(exc).__name__
    told = diagnose(run)
    assert (told.state, told.what) == (state, what)


def test_other_exceptions_and_other_ranks_leave_no_record(tmp_path: Path) -> None:
    """A failed rank is the launcher's to record (it sees every rank); a rank without the run
    directory records nothing."""
    run = _run_dir(tmp_path)
    record_ending(run, ValueError("bad batch"), step=3)
    record_ending(None, KeyboardInterrupt(), step=3)
    assert not (run / "failure.json").exists()
    assert diagnose(run).state == "stopped"   # no record: killed, or its machine lost
