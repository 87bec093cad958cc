"""The lock a run holds on its run directory, so that two runs never write into the same one.

The lock is a file, ``scaleloop.lock``, created exclusively (``O_EXCL``) and holding the
holder's host, pid, process start time and the time it was taken. It needs no lock server and
works on any file system that creates files atomically. A lock whose process is gone (same
host, pid dead or reused) is stale and is taken over; a lock held on another host cannot be
checked from here and is reported with the way to remove it.

``scaleloop train --nproc N`` takes the lock in the launcher, which outlives torchrun's
restarts of its workers; rank 0 of those workers then finds a lock held by its own ancestor
and shares it (it neither takes nor releases it). A single-process run takes it itself.
A job over several machines takes none (see :func:`lock_run_dir`).

A dead holder is not enough to call a lock stale: its workers may still be writing (they are
killed with it, but not in the same instant). So every writer holds a shared ``flock`` on the
lock file while it lives: the holder itself, and each process started with
:meth:`RunDirLock.writers_env` that calls :func:`join_writers` (torchrun's agent and each
worker). The kernel drops a process's ``flock`` when the process ends, however it ends, so a
lock is taken over only when its holder is gone and no process holds the file any more.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Mapping, Optional

from scaleloop.errors import UsageError
from scaleloop.output.unwritable import unwritable

LOCK_FILE = "scaleloop.lock"
# Set by a launcher that holds a lock for the processes it starts: the lock file they hold too.
WRITERS_VAR = "SCALELOOP_RUN_LOCK"
_READ_TRIES = 5        # a lock read while its holder is still writing it looks empty for a moment


class RunDirLocked(UsageError):
    """Another live run holds the run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lock."""

    host: str
    pid: int
    since: float                    # time.time() when it was taken
    start: Optional[str] = None     # the process's start time (Linux), to tell a reused pid

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]   # field 22 of stat; the name before ")" may hold spaces


def _parent(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:  # no /proc (macOS): ask ps
        out = subprocess.run(["ps", "-o", "ppid=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _lineage(pid: int) -> set[int]:
    """``pid`` and its ancestors."""
    seen: set[int] = set()
    current: Optional[int] = pid
    while current is not None and current > 1 and current not in seen and len(seen) < 64:
        seen.add(current)
        current = _parent(current)
    return seen


def _is_ours(holder: Holder) -> bool:
    """Held by this process or one of its ancestors (the launcher of this torchrun worker)."""
    return holder.host == socket.gethostname() and holder.pid in _lineage(os.getpid())


def _alive(holder: Holder) -> bool:
    """False only when the holder is surely gone: on this host, and its pid is dead or reused."""
    if holder.host != socket.gethostname():
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start = _start_time(holder.pid)
    return holder.start is None or start is None or start == holder.start


def _read(path: Path) -> tuple[Optional[Holder], Optional[str]]:
    """The lock's holder and raw text; (None, None) if there is no lock, (None, text) if unreadable."""
    text = ""
    for attempt in range(_READ_TRIES):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None, None
        except OSError:
            text = ""
        try:
            data = json.loads(text)
            return Holder(str(data["host"]), int(data["pid"]), float(data["since"]), data.get("start")), text
        except (ValueError, KeyError, TypeError):
            time.sleep(0.05 * (attempt + 1))
    return None, text


def _hold_shared(path: Path) -> Optional[int]:
    """A descriptor holding a shared ``flock`` on ``path`` (None: no such file, or no flock here)."""
    if sys.platform == "win32":   # no flock: a dead holder's lock is stale at once, as before
        return None
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)   # waits only while another run checks the file (below)
    except OSError:
        os.close(fd)
        return None
    return fd


def _writers_alive(path: Path) -> bool:
    """Whether a process still holds ``path`` as a writer (see the module doc)."""
    if sys.platform == "win32":
        return False
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False    # a file system without flock: nothing to tell
    finally:
        os.close(fd)    # also drops the probe's own flock
    return False


# This process's shared flocks as a writer: kept open until it ends (the kernel then drops them).
_JOINED: list[int] = []


def join_writers(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Count this process as one of the writers of the lock named in :data:`WRITERS_VAR`, until
    it ends; a process started for a run (torchrun's agent, each worker) calls it first thing.

    Returns whether it joined (False when no lock is named, or the file is gone).
    """
    named = (os.environ if environ is None else environ).get(WRITERS_VAR)
    if not named:
        return False
    fd = _hold_shared(Path(named))
    if fd is None:
        return False
    _JOINED.append(fd)
    return True


def _refusal(run_dir: Path, holder: Holder) -> RunDirLocked:
    text = (f"--out {str(run_dir)!r} is in use by another scaleloop run ({holder.describe()}); wait for it "
            "to end, or choose another --out")
    if holder.host != socket.gethostname():
        text += f"; if that run is gone, delete {str(run_dir / LOCK_FILE)!r}"
    return RunDirLocked(text)


def _writers_refusal(run_dir: Path, holder: Optional[Holder]) -> RunDirLocked:
    whose = f" (its launcher, {holder.describe()}, has ended)" if holder is not None else ""
    return RunDirLocked(f"--out {str(run_dir)!r} is still being written by the processes of another scaleloop "
                        f"run{whose}; wait for them to end, or choose another --out")


def live_holder(run_dir: Path) -> Optional[Holder]:
    """The holder of ``run_dir``'s lock while its run lives: on this host, a live process whose
    start time matches the one the lock recorded (a reused pid is not the run); on another host,
    whoever the lock names (it cannot be checked from here). None when no run holds it."""
    holder, _ = _read(run_dir / LOCK_FILE)
    return holder if holder is not None and _alive(holder) else None


def refuse_if_locked(run_dir: Path) -> None:
    """Raise :class:`RunDirLocked` if a live run other than this one (or its launcher) holds ``run_dir``,
    or the processes of a run whose holder has ended still write there."""
    path = run_dir / LOCK_FILE
    holder, text = _read(path)
    if holder is not None and _is_ours(holder):
        return
    if holder is not None and _alive(holder):
        raise _refusal(run_dir, holder)
    if text is not None and _writers_alive(path):
        raise _writers_refusal(run_dir, holder)


class RunDirLock:
    """The lock on one run directory; use :func:`lock_run_dir` to take it.

    ``owned`` is False when the lock is shared with the process's ancestor that holds it (a
    torchrun worker under scaleloop's launcher): :meth:`release` then leaves it in place.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.owned = False
        self.held = False
        self._fd: Optional[int] = None   # this process's shared flock on the file, while it owns it

    def acquire(self) -> "RunDirLock":
        """Take the lock, share an ancestor's, or take over a stale one; else raise :class:`RunDirLocked`."""
        for _ in range(3):
            if self._create():
                self.owned = self.held = True
                self._fd = _hold_shared(self.path)   # a new file: no other process holds it yet
                return self
            holder, text = _read(self.path)
            if text is None:
                continue            # released meanwhile: try again
            if holder is not None and _is_ours(holder):
                self.held = True
                return self
            if holder is not None and _alive(holder):
                raise _refusal(self.run_dir, holder)
            if _writers_alive(self.path):   # the holder is gone, but not all of its processes
                raise _writers_refusal(self.run_dir, holder)
            self._take_over(text)   # its holder is gone (or it was never written whole)
        holder, _ = _read(self.path)
        raise _refusal(self.run_dir, holder or Holder("?", -1, time.time()))

    def _create(self) -> bool:
        me = Holder(socket.gethostname(), os.getpid(), time.time(), _start_time(os.getpid()))
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        text = json.dumps(asdict(me))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            # A full disk still creates the (empty) file: removed, or the next run would find an
            # unreadable lock and wait on it. Said as every other file of the run directory that
            # cannot be written.
            self.path.unlink(missing_ok=True)
            raise unwritable(self.path, exc, needed=len(text.encode()),
                             then="once space is freed, run the same command again"
                             if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
                             "once the directory is writable, run the same command again") from None
        return True

    def _take_over(self, stale_text: str) -> None:
        """Remove a stale lock, unless another process replaced it meanwhile (then put that one back)."""
        aside = self.path.with_name(f".{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_text(encoding="utf-8") != stale_text:
                os.link(aside, self.path)   # a fresh lock taken meanwhile: restore it (never over another)
        except OSError:
            pass
        aside.unlink(missing_ok=True)

    def writers_env(self) -> dict[str, str]:
        """The environment entry by which processes this one starts count as writers of the run
        (:func:`join_writers`); empty when this process does not own the lock."""
        return {WRITERS_VAR: str(self.path)} if self.owned else {}

    def release(self) -> None:
        """Free the lock if this process took it (safe to call twice)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.owned:
            holder, _ = _read(self.path)
            if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
                try:
                    self.path.unlink()
                except OSError:
                    pass  # a read-only directory: the lock is stale once this process ends
        self.owned = self.held = False

    def __enter__(self) -> "RunDirLock":
        # Taken by lock_run_dir, or deliberately not for a job over several machines (whose rank 0
        # enters it all the same): entering only scopes the release.
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()


def lock_run_dir(run_dir: Path, *, single_node: bool = True) -> RunDirLock:
    """Take the lock on ``run_dir`` (an existing directory) now; release it with ``release()`` or
    use the result in ``with``. A second run into the same directory is refused with one line
    naming the holder.

    ``single_node=False`` (a job over several machines) takes no lock and returns one that holds
    nothing: each node's launcher prepares the same shared directory, and whether a process on
    another machine is alive cannot be checked from here.
    """
    lock = RunDirLock(run_dir)
    return lock.acquire() if single_node else lock
