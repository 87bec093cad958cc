"""The one-line error for a run-directory file that cannot be written (disk full, read-only):
the file, why, the space it needed against the space free, and what to do next.

Its own module because the lock (``output.lock``) needs it, and ``output.rundir`` needs the lock.
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Optional

from scaleloop.errors import UsageError


class RunDirWriteError(UsageError):
    """A file of the run directory cannot be written (disk full, read-only, ...): one line
    naming the file, what it needed, and how to continue.

    ``once`` says what must change before the run can go on ("space is freed", ...).
    """

    def __init__(self, message: str, once: str = "the run directory is writable again") -> None:
        super().__init__(message)
        self.once = once

    def with_hint(self, hint: str) -> "RunDirWriteError":
        """The same error with ``hint`` (where and how to continue) added, if it has none yet."""
        if not hint or "continue with:" in str(self) or "start over" in str(self):
            return self
        return RunDirWriteError(f"{self}; {hint}", self.once)


def size_text(n: float) -> str:
    """``n`` bytes in words: ``74 bytes``, ``4.1 KB``, ``2.4 MB``."""
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: Path) -> Optional[int]:
    """The bytes free on the file system of ``path`` (or of the nearest folder above it that exists)."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def unwritable(path: Path, exc: OSError, *, needed: Optional[int] = None, then: str = "") -> RunDirWriteError:
    """The one-line error for a run-directory file that cannot be written: the file, why, the
    space it needed against the space free, and ``then`` (what to do next)."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "disk full" if exc.errno == errno.ENOSPC else exc.strerror or exc.__class__.__name__
    text = f"cannot write {str(path)!r}: {why[:1].lower() + why[1:]}"
    if needed is not None:
        free = free_bytes(path.parent)
        text += f" (it needs {size_text(needed)}" + (f", {size_text(free)} free)" if free is not None else ")")
    return RunDirWriteError(text + (f"; {then}" if then else ""),
                            "space is freed" if full else "the run directory is writable again")
