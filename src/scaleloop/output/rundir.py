"""The run directory: where a run's config, metrics, curves and weights are written (rank 0).

A run directory is recognisable as one (:func:`is_run_dir`: scaleloop's own ``config.toml``,
``metrics.csv``, checkpoints or lock), so that ``--out`` never writes into a directory of the
user's own files. While a run writes into it, it holds a lock (:class:`RunDirLock`).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from scaleloop.errors import UsageError
from scaleloop.output.unwritable import RunDirWriteError, unwritable  # noqa: F401 (also imported from here)
from scaleloop.output.lock import LOCK_FILE, RunDirLock, lock_run_dir, refuse_if_locked

__all__ = ["LOCK_FILE", "RunDirLock", "RunDirWriteError", "default_run_dir", "is_run_dir", "lock_run_dir",
           "prepare_run_dir", "refuse_if_in_use", "unwritable", "write_atomic"]

# First bytes of the files only scaleloop writes this way: they mark a directory as a run.
LOGS_DIR = "logs"   # each rank's log, torchrun's messages, fault records (scaleloop.launching.failures)
_CONFIG_HEAD = "# scaleloop "
_TEMPORARY = re.compile(r"^\.[^/]+\.tmp-\d+$")   # write_atomic's: .<name>.tmp-<pid>
_METRICS_HEAD = "kind,epoch,step"


def default_run_dir(model: str, data: str, root: str = "runs") -> Path:
    """``runs/<date>-<time>-<model>-<data>``, made unique if a run started in the same second."""
    def clean(s: str) -> str:
        return "".join(c if c.isalnum() else "_" for c in s.rsplit(":", 1)[-1])[:24]

    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{clean(model)}-{clean(data)}"
    path = Path(root) / stem
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stem}-{n}"
    return path


def _starts_with(path: Path, head: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(len(head)) == head
    except OSError:
        return False


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run that scaleloop wrote (its config, metrics, checkpoints or lock)."""
    return (_starts_with(path / "config.toml", _CONFIG_HEAD) or _starts_with(path / "metrics.csv", _METRICS_HEAD)
            or (path / LOCK_FILE).exists() or any((path / "checkpoints").glob("step-*/manifest.json")))


def refuse_if_in_use(out: Optional[Path]) -> None:
    """Refuse ``out`` while another run writes there: said first, before this run reads anything
    of it (its checkpoints, its config), so that the reason given is the real one."""
    if out is not None and Path(out).is_dir():
        refuse_if_locked(Path(out))


# What a run that stopped before its first step leaves, besides its logs: removed when the
# corrected command starts over in the same directory (its config is written anew).
_FAILED_START_FILES = ("metrics.csv", "failure.json", "config.toml")


def never_stepped(path: Path) -> bool:
    """Whether the run in ``path`` stopped before it finished a step: no metrics row, no
    checkpoint, no final weights (a model or data that failed at start-up, a bad setting)."""
    metrics = path / "metrics.csv"
    try:
        rows = metrics.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        rows = []
    return (len(rows) <= 1 and not (path / "model.pt").exists()
            and not any((path / "checkpoints").glob("step-*")))


def _machines_of(config: Path) -> int:
    """How many machines the run of ``config`` (a config.toml scaleloop wrote) spans: its
    ``[launch] nnodes``, the most of an elastic job's; 1 where it cannot be read."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        nnodes = tomllib.loads(config.read_text(encoding="utf-8")).get("launch", {}).get("nnodes", 1)
    except (OSError, ValueError):
        return 1
    return nnodes if isinstance(nnodes, int) else 1


def another_machine_starting(path: Path) -> bool:
    """Whether the run in ``path`` is one that another machine of a several-machine job is starting
    now, in an ``--out`` all machines share: every machine's launcher writes the job's config.toml
    there before the workers meet, so the machine that comes second finds it with no step taken.
    That is no run that stopped before its first step: a start that failed records it
    (failure.json), and only then is the directory one to start over in."""
    return not (path / "failure.json").exists() and _machines_of(path / "config.toml") > 1


def _note(message: str) -> None:
    print(f"scaleloop: {message}", file=sys.stderr, flush=True)


def prepare_run_dir(out: Optional[str], model: str, data: str, *, continuing: bool = False,
                    say: Callable[[str], None] = _note) -> Path:
    """Create the run directory; refuse one that already holds a run, a run that is still
    writing there, or a directory of other files, so nothing is overwritten.

    ``continuing``: this run resumes the run in that directory (or is its restarted worker
    group), so an existing run there is expected. A run there that stopped before its first
    step (:func:`never_stepped`) is not one to keep: the retry starts over in the directory,
    and ``say`` says so in one line. Another machine of the same job starting in a shared
    directory (:func:`another_machine_starting`) is neither: its files stay, and nothing is said.
    """
    path = Path(out) if out else default_run_dir(model, data)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    if path.is_dir():
        refuse_if_locked(path)   # before anything else: a live run there is the first thing to say
        started_over = False
        # A run killed between writing its config.toml and its metrics.csv left only the former.
        left_a_run = (any((path / name).exists() for name in ("metrics.csv", "failure.json"))
                      or _starts_with(path / "config.toml", _CONFIG_HEAD))
        if not continuing and left_a_run and not (never_stepped(path) and another_machine_starting(path)):
            if not never_stepped(path):
                if (path / "config.toml").is_file() and not any((path / "checkpoints").glob("step-*")):
                    # It trained, but no checkpoint holds where it was: it can only start over, elsewhere.
                    raise UsageError(f"--out {str(path)!r} already holds a run that wrote no checkpoint to continue "
                                     "from; start it over, keeping its results, with: scaleloop train --config "
                                     f"{shlex.quote(str(path / 'config.toml'))} --out {shlex.quote(str(path) + '-2')}")
                raise UsageError(f"--out {str(path)!r} already holds a run (metrics.csv) and this run does not "
                                 "resume it; choose a new --out so that its results are not overwritten")
            for name in _FAILED_START_FILES:
                (path / name).unlink(missing_ok=True)
            started_over = True
            logged = any(p.is_file() for p in (path / "logs").rglob("*"))
            kept = " (that run's logs are kept, in logs/)" if logged else ""
            say(f"note: --out {str(path)!r} held a run that stopped before its first step; this run starts "
                f"over in it{kept}")
        # Another machine of the job, writing into the same (shared) directory, may be halfway
        # through one of scaleloop's atomic writes: its temporary file is not a foreign file.
        entries = sorted(p.name for p in path.iterdir() if not _TEMPORARY.match(p.name))
        if entries and not started_over and not is_run_dir(path):
            shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
            raise UsageError(f"--out {str(path)!r} holds files that scaleloop did not write ({shown}); a run "
                             "never overwrites them: choose a new or empty --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {str(path)!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--out {str(path)!r} is not writable; choose another --out")
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename, so a reader never sees half.

    A failed write (disk full, read-only) leaves no temporary file and raises
    :class:`RunDirWriteError` naming ``path`` and the bytes it needed.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise unwritable(path, exc, needed=len(data)) from None
