"""The run directory: where a run's config, metrics, curves and weights are written (rank 0)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from scaleloop.errors import UsageError


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


def prepare_run_dir(out: Optional[str], model: str, data: str, *, continuing: bool = False) -> Path:
    """Create the run directory; refuse one that already holds a run, so nothing is overwritten.

    ``continuing``: this run resumes the run in that directory (or is its restarted worker
    group), so an existing run there is expected.
    """
    path = Path(out) if out else default_run_dir(model, data)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    if not continuing and path.is_dir() and (path / "metrics.csv").exists():
        raise UsageError(f"--out {str(path)!r} already holds a run (metrics.csv) and this run does not resume it; "
                         "choose a new --out so that its results are not overwritten")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {str(path)!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--out {str(path)!r} is not writable; choose another --out")
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename, so a reader never sees half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
