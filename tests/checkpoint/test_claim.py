"""The run directory is claimed once: by the launcher for its workers (rank 0 joins), else by rank 0."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.checkpoint.claim import CLAIMED_VAR, claim_run_dir, claimed_by_launcher
from scaleloop.errors import UsageError
from scaleloop.output.lock import LOCK_FILE, WRITERS_VAR


def _finished_run(path: Path) -> None:
    """A run directory whose run took steps (so a new run must not write over it)."""
    path.mkdir(parents=True)
    (path / "metrics.csv").write_text("step,epoch,loss\n1,0,0.5\n2,0,0.4\n")
    (path / "config.toml").write_text("# scaleloop run config\n")


def test_a_new_directory_is_created_locked_and_handed_on(tmp_path: Path) -> None:
    with claim_run_dir(tmp_path / "run", "simplenet", "digits") as claim:
        assert claim.path == tmp_path / "run" and claim.path.is_dir()
        assert (claim.path / LOCK_FILE).exists() and not claim.by_launcher
        env = claim.workers_env()
        assert env[CLAIMED_VAR] == str(claim.path) and env[WRITERS_VAR] == str(claim.path / LOCK_FILE)
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_without_out_a_new_directory_is_named_after_model_and_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with claim_run_dir(None, "simplenet", "digits") as claim:
        assert claim.path.is_dir() and "simplenet" in claim.path.name and "digits" in claim.path.name


def test_a_run_that_does_not_continue_the_one_there_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLAIMED_VAR, raising=False)
    _finished_run(tmp_path / "run")
    with pytest.raises(UsageError, match="already holds a run"):
        claim_run_dir(tmp_path / "run", "simplenet", "digits")
    assert (tmp_path / "run" / "metrics.csv").read_text().count("\n") == 3   # nothing of it touched


@pytest.mark.parametrize("why", ["restarting", "from_copy"])
def test_a_restart_or_a_resume_from_a_copy_continues_it(tmp_path: Path, why: str) -> None:
    _finished_run(tmp_path / "run")
    with claim_run_dir(tmp_path / "run", "simplenet", "digits", **{why: True}) as claim:
        assert (claim.path / "metrics.csv").exists()


def test_the_launchers_claim_is_joined_not_decided_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher claimed the directory and wrote into it; rank 0 of its workers, which
    # resumes nothing itself, finds the claim in its environment and joins it.
    launcher = claim_run_dir(tmp_path / "run", "simplenet", "digits")
    (launcher.path / "metrics.csv").write_text("step,epoch,loss\n1,0,0.5\n")
    monkeypatch.setenv(CLAIMED_VAR, str(tmp_path / "run" / "."))
    assert claimed_by_launcher(tmp_path / "run")
    assert not claimed_by_launcher(tmp_path / "other")
    try:
        worker = claim_run_dir(tmp_path / "run", "simplenet", "digits")
        assert worker.by_launcher and worker.lock.held and not worker.lock.owned   # shares the launcher's lock
        worker.release()
        assert (tmp_path / "run" / LOCK_FILE).exists()          # still the launcher's
    finally:
        launcher.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
