"""The run directory: what --out accepts, its lock, and writes that fail (scaleloop.output.rundir/lock)."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scaleloop.errors import UsageError
from scaleloop.output import rundir
from scaleloop.output.lock import LOCK_FILE, WRITERS_VAR, RunDirLocked
from scaleloop.output.rundir import RunDirWriteError, is_run_dir, lock_run_dir, prepare_run_dir, write_atomic

SRC = Path(__file__).resolve().parents[2] / "src"


def prepare(path: Path, continuing: bool = False) -> Path:
    return prepare_run_dir(str(path), "simplenet", "digits", continuing=continuing)


def test_a_directory_of_the_users_own_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"mine")
    with pytest.raises(UsageError, match=r"holds files that scaleloop did not write \(model.pt\); a run never "
                                         r"overwrites them: choose a new or empty --out"):
        prepare(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"] and (tmp_path / "model.pt").read_bytes() == b"mine"


def test_an_empty_or_scaleloop_directory_is_accepted(tmp_path: Path) -> None:
    assert prepare(tmp_path / "new") == tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(empty) == empty
    started = tmp_path / "started"        # what a launcher leaves before its workers log anything
    started.mkdir()
    (started / "config.toml").write_text("# scaleloop resolved configuration; rerun with: ...\nmodel = \"x\"\n")
    (started / "logs").mkdir()
    assert is_run_dir(started) and prepare(started) == started
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.toml").write_text("[tool.other]\n")   # someone else's config.toml
    assert not is_run_dir(other)


def test_a_finished_run_is_refused_unless_continued(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("kind,epoch,step,samples\nstep,1,1,64\n")
    with pytest.raises(UsageError, match="already holds a run"):
        prepare(tmp_path)
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 2      # left as it was
    assert prepare(tmp_path, continuing=True) == tmp_path


def test_a_run_that_trained_but_kept_no_checkpoint_is_refused_saying_how_to_start_it_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("# scaleloop resolved configuration; rerun with: ...\nepochs = 1\n")
    (run / "metrics.csv").write_text("kind,epoch,step,samples\nstep,1,1,64\n")
    (run / "checkpoints" / ".tmp-step-00000005-1").mkdir(parents=True)   # its first, half written
    with pytest.raises(UsageError, match=rf"already holds a run that wrote no checkpoint to continue from; start it "
                                         rf"over, keeping its results, with: scaleloop train --config "
                                         rf"{run}/config.toml --out {run}-2$"):
        prepare(run)
    assert (run / "config.toml").read_text().endswith("epochs = 1\n")


@pytest.mark.parametrize("kept", ["checkpoint", "weights", "row"])
def test_a_run_that_trained_a_step_is_kept_whatever_shows_it(tmp_path: Path, kept: str) -> None:
    (tmp_path / "metrics.csv").write_text("kind,epoch,step,samples\n" + ("step,1,1,64\n" if kept == "row" else ""))
    if kept == "checkpoint":
        (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    if kept == "weights":
        (tmp_path / "model.pt").write_bytes(b"weights")
    assert not rundir.never_stepped(tmp_path)
    with pytest.raises(UsageError, match="already holds a run"):
        prepare(tmp_path)


@pytest.mark.parametrize("metrics", [True, False], ids=["metrics-header", "no-metrics"])
def test_a_run_that_stopped_before_its_first_step_is_started_over(tmp_path: Path, metrics: bool) -> None:
    """The obvious retry (the corrected command, the same --out) is not refused, and the failed
    start's record goes (a start under torchrun that fails before the loop leaves no metrics.csv)."""
    (tmp_path / "config.toml").write_text("# scaleloop resolved configuration; rerun with: ...\nmodel = \"x\"\n")
    if metrics:
        (tmp_path / "metrics.csv").write_text("kind,epoch,step,samples\n")
    (tmp_path / "failure.json").write_text("{}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.log").write_text("the failed start's output\n")
    said: list[str] = []
    assert rundir.never_stepped(tmp_path)
    assert prepare_run_dir(str(tmp_path), "m", "d", say=said.append) == tmp_path
    assert said == [f"note: --out {str(tmp_path)!r} held a run that stopped before its first step; this run "
                    "starts over in it (that run's logs are kept, in logs/)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert (tmp_path / "logs" / "rank-0.log").read_text() == "the failed start's output\n"


def test_a_run_killed_before_its_metrics_file_is_started_over_too(tmp_path: Path) -> None:
    """Killed between writing its config.toml and its metrics.csv (a busy machine widens that gap):
    the retry says that it starts over, as for any run that stopped before its first step."""
    (tmp_path / "config.toml").write_text("# scaleloop resolved configuration; rerun with: ...\nmodel = \"x\"\n")
    said: list[str] = []
    assert prepare_run_dir(str(tmp_path), "m", "d", say=said.append) == tmp_path
    # It left no logs: the note does not speak of any.
    assert said == [f"note: --out {str(tmp_path)!r} held a run that stopped before its first step; this run "
                    "starts over in it"]
    assert list(tmp_path.iterdir()) == []


def test_a_config_file_the_user_wrote_is_never_taken_for_a_run(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("model = \"x\"\n")
    with pytest.raises(UsageError, match="holds files that scaleloop did not write"):
        prepare_run_dir(str(tmp_path), "m", "d", say=lambda _m: None)
    assert (tmp_path / "config.toml").read_text() == "model = \"x\"\n"


def _hold_in_child(path: Path) -> subprocess.Popen:
    """A process (not our ancestor) that holds the lock on ``path`` until its stdin closes."""
    code = ("import sys; from pathlib import Path; from scaleloop.output.rundir import lock_run_dir\n"
            f"lock = lock_run_dir(Path({str(path)!r})); print('held', flush=True); sys.stdin.read(); lock.release()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(SRC)})
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_second_run_is_refused_with_the_holder_named(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path)
    try:
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == child.pid and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked, match=rf"--out '{tmp_path}' is in use by another scaleloop run \(pid "
                                               rf"{child.pid} on {socket.gethostname()}, since .*\); wait for it to "
                                               "end, or choose another --out$"):
            lock_run_dir(tmp_path)
        with pytest.raises(RunDirLocked):   # prepare_run_dir says so first, even for a run that continues
            prepare(tmp_path, continuing=True)
    finally:
        child.communicate("", timeout=30)
    assert not (tmp_path / LOCK_FILE).exists()        # released by its holder
    with lock_run_dir(tmp_path) as lock:
        assert lock.owned
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_stale_lock_is_taken_over_and_a_remote_one_is_not(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 1.0}))
    with lock_run_dir(tmp_path) as lock:
        assert lock.owned and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 12, "since": 1.0}))
    with pytest.raises(RunDirLocked, match=rf"pid 12 on elsewhere.*; if that run is gone, delete "
                                           rf"'{tmp_path / LOCK_FILE}'"):
        lock_run_dir(tmp_path)


def test_a_stale_lock_is_not_taken_over_while_its_writers_live(tmp_path: Path) -> None:
    # A launcher killed outright: its lock names a dead pid, but a worker it started still holds
    # the lock file as a writer (join_writers). A second run is refused until that worker ends.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 1.0}))
    code = ("import sys; from scaleloop.output.lock import join_writers\n"
            "print(join_writers(), flush=True); sys.stdin.read()")
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(SRC), WRITERS_VAR: str(tmp_path / LOCK_FILE)})
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "True"
        with pytest.raises(RunDirLocked, match=rf"--out '{tmp_path}' is still being written by the processes of "
                                               rf"another scaleloop run \(its launcher, pid {dead.pid} on "):
            lock_run_dir(tmp_path)
        with pytest.raises(RunDirLocked, match="still being written"):
            prepare(tmp_path, continuing=True)
    finally:
        writer.communicate("", timeout=30)
    with lock_run_dir(tmp_path) as lock:    # its last writer gone: stale, taken over
        assert lock.owned and lock.writers_env() == {WRITERS_VAR: str(tmp_path / LOCK_FILE)}


def test_a_lock_held_by_an_ancestor_is_shared_not_released(tmp_path: Path) -> None:
    # As rank 0 of a torchrun worker group finds its launcher's lock: held by a parent process.
    code = ("import os; from pathlib import Path; from scaleloop.output.rundir import lock_run_dir\n"
            f"lock = lock_run_dir(Path({str(tmp_path)!r})); print(lock.owned); lock.release()")
    with lock_run_dir(tmp_path) as mine:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(SRC)})
        assert out.stdout.strip() == "False", out.stderr
        assert (tmp_path / LOCK_FILE).exists() and mine.owned
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_write_that_fails_names_the_file_and_leaves_no_temporary(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir.os, "fsync", full)
    with pytest.raises(RunDirWriteError, match=rf"^cannot write '{tmp_path / 'model.pt'}': disk full "
                                               r"\(it needs 2.0 KB, .* free\)$") as caught:
        write_atomic(tmp_path / "model.pt", b"x" * 2000)
    assert caught.value.once == "space is freed"
    assert list(tmp_path.iterdir()) == []


def test_a_job_over_several_machines_takes_no_lock(tmp_path: Path) -> None:
    lock = lock_run_dir(tmp_path, single_node=False)
    assert not (tmp_path / LOCK_FILE).exists() and not lock.owned
    with lock:   # as rank 0 of such a job holds it while it trains
        assert not (tmp_path / LOCK_FILE).exists() and not lock.owned
    lock.release()


def test_another_machines_write_in_progress_is_not_a_foreign_file(tmp_path: Path) -> None:
    """Machines sharing one --out: one may be halfway through write_atomic when another looks."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / ".config.toml.tmp-4242").write_text("# scaleloop resolved config")   # the other machine's
    assert prepare(shared) == shared
    (shared / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"holds files that scaleloop did not write \(notes.txt\)"):
        prepare(shared)
