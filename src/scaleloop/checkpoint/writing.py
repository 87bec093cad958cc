"""The writing rank's side of a save: one checkpoint's files, and the one line when they cannot be.

The same functions write a checkpoint on the training thread and, with ``--async-checkpoint``, in
the background (``checkpoint.background``): ``state.pt`` and the manifest into the temporary
directory, renamed into place, then ``latest`` and the pruning, in that order (``store``). A
failure is returned as the line that ends the run, with the temporary directory removed, so that
the newest valid checkpoint and ``latest`` stay what they were. No collective here: the
checkpointer sends the outcome to every rank.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from scaleloop.checkpoint.background import Outcome
from scaleloop.checkpoint.state import to_bytes
from scaleloop.checkpoint.store import (STATE_FILE, CheckpointError, finish_checkpoint, newest_valid, prune,
                                        step_dir_name)
from scaleloop.output.rundir import unwritable

#: Room for what a checkpoint holds beside its tensors: the manifest, DCP's ``.metadata`` and the
#: files' headers, and the file system's rounding up to whole blocks.
SLACK = 64 * 1024


def write_files(root: Path, keep: int, step: int, tmp: Path, state: dict[str, Any], meta: dict[str, Any],
                needed: Optional[int], shards: Optional[Callable[[], None]] = None) -> Outcome:
    """The checkpoint of ``step`` under ``root`` from ``state`` (``state.pt``'s entries) and ``meta``
    (the manifest's), written into ``tmp`` and renamed into place; then ``latest`` and the pruning
    to ``keep``. ``shards``: first wait for a sharded checkpoint's shards (DCP's thread); ``needed``:
    the space its check asked for, named if it fails there. Returns the path, or the one-line error,
    and whether that error is a refusal (shards missing) rather than a file not written."""
    where = root / step_dir_name(step)
    try:
        if shards is not None:
            shards()
        data = to_bytes(state)
        state.clear()   # a background write's copy of the state: freed once it is bytes
        needed = len(data) + SLACK
        room_for(tmp, needed)
        path = finish_checkpoint(root, step, tmp, {STATE_FILE: data}, meta)
        prune(root, keep)
    except OSError as exc:
        return None, write_error(root, where, exc, needed, tmp), False
    except CheckpointError as exc:   # a sharded checkpoint whose shards this rank cannot see
        shutil.rmtree(tmp, ignore_errors=True)
        return None, str(exc), True
    return path, None, False


def write_error(root: Optional[Path], file: Path, exc: OSError, needed: Optional[int], tmp: Optional[Path] = None) -> str:
    """The one line for a checkpoint that could not be written; removes its temporary directory
    first, so the newest valid checkpoint (and ``latest``) stay what they were, the space free
    is what the checkpoint could have had, and the ranks' error records have room."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    once = unwritable(file, exc).once
    return str(unwritable(file, exc, needed=needed, then=continue_hint(root, once) if root is not None else ""))


def continue_hint(root: Path, once: str) -> str:
    """``the newest valid checkpoint is X; once <once>, continue with: scaleloop train --out R``
    (``root``: the run's checkpoints directory; verifies the checkpoint it names)."""
    run_dir = shlex.quote(str(root.parent))
    found = newest_valid(root, warn=lambda _msg: None)
    if found is None:
        return f"no valid checkpoint yet; once {once}, start over with the same command"
    return (f"the newest valid checkpoint is {str(found.path)!r} (step {found.step}); once {once}, "
            f"continue with: scaleloop train --out {run_dir}")


def room_for(directory: Path, needed: Optional[int]) -> None:
    """OSError ENOSPC, before anything is written, when ``directory``'s file system has less than
    ``needed`` bytes free (a full disk part-way through a write is still caught where it happens)."""
    if needed is None:
        return
    for existing in (directory, *directory.parents):   # checkpoints/ appears with the first checkpoint
        try:
            free = shutil.disk_usage(existing).free
        except OSError:
            continue
        if needed > free:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return
