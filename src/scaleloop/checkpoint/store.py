"""Checkpoints on disk: one directory per checkpoint, written so that a crash never leaves a bad one.

Layout of a run's checkpoints::

    <run>/checkpoints/
        step-00000040/          one checkpoint: the state after optimizer step 40
            state.pt            torch.save of tensors and plain values only (weights-only loadable)
            manifest.json       format version, step, epoch, world size, and each file's size + SHA-256
        step-00000080/
        latest                  the name of the newest complete checkpoint (moved only after it is whole)

A sharded checkpoint (``--strategy fsdp``) holds, next to ``state.pt`` (everything but the model
and optimizer), the files of ``torch.distributed.checkpoint``: one ``__<rank>_0.distcp`` per rank
and ``.metadata``; every rank writes its own into the same temporary directory, and the
manifest lists them all.

A checkpoint is first written to a hidden ``.tmp-step-...`` directory next to the others: every
file is fsynced, then the manifest (last), then the directory is renamed to its final name and
the parent directory fsynced. A process killed at any moment therefore leaves either no new
checkpoint or a complete one; a leftover temporary directory is ignored and cleaned up later.
The manifest's checksums catch what atomic renames cannot: a file damaged or truncated later.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from scaleloop.checkpoint import untrusted
from scaleloop.errors import CheckpointError

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory whose manifest and checksums have been verified."""

    path: Path
    step: int
    meta: Mapping[str, Any]

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory that holds the new name is flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checkpoint(root: Path, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]) -> Path:
    """Write ``files`` as the checkpoint for ``step`` under ``root``, atomically; returns its path.

    ``meta`` (JSON-serialisable) goes into the manifest next to each file's size and SHA-256.
    Only after the checkpoint is complete and renamed is the ``latest`` pointer moved.
    """
    return finish_checkpoint(root, step, begin_checkpoint(root, step), files, meta)


def begin_checkpoint(root: Path, step: int) -> Path:
    """Create (empty) the hidden temporary directory that the checkpoint for ``step`` is written into.

    Other writers (the ranks of a sharded checkpoint) may put their files into it too, before
    :func:`finish_checkpoint` adds the manifest and renames it into place.
    """
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_checkpoint(root: Path, step: int, tmp: Path, files: Mapping[str, bytes],
                      meta: Mapping[str, Any]) -> Path:
    """Add ``files`` to ``tmp``, then the manifest of EVERY file in it, and rename it to ``step-N``.

    Files already in ``tmp`` (written by other processes) are fsynced and checksummed too, so
    the manifest covers the whole checkpoint. Only then is the ``latest`` pointer moved.
    """
    final = root / step_dir_name(step)
    entries = {}
    for name, data in files.items():
        _write_file(tmp / name, data)
        entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for file in sorted(tmp.rglob("*")):
        name = file.relative_to(tmp).as_posix()
        if name in entries or name == MANIFEST_FILE or not file.is_file():
            continue
        _fsync_file(file)
        entries[name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "created": time.time(),
                **meta, "files": entries}
    _write_file(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())
    for sub in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(sub)
    _publish(root, tmp, final)
    return final


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``, then move the ``latest`` pointer to it."""
    if final.exists():
        # The same step saved again (e.g. a resumed run that ends where it resumed): swap it
        # out of the way first, since a directory cannot be renamed over a non-empty one.
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    _write_file(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / LATEST_FILE)
    _fsync_dir(root)


def copy_checkpoint(root: Path, step: int, files: Mapping[str, bytes]) -> CheckpointInfo:
    """Write another machine's checkpoint ``files`` (its manifest among them, unchanged) as the
    checkpoint for ``step`` under ``root``, as atomically as :func:`finish_checkpoint`; then verify
    every file against that manifest. Returns the verified copy; CheckpointError if it differs."""
    tmp = begin_checkpoint(root, step)
    for name in sorted(files, key=lambda n: n == MANIFEST_FILE):   # the manifest last
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_file(target, files[name])
    for sub in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(sub)
    try:
        verify_checkpoint(tmp)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / step_dir_name(step)
    _publish(root, tmp, final)
    return CheckpointInfo(path=final, step=step, meta=json.loads(files[MANIFEST_FILE]))


def verify_checkpoint(path: Path) -> CheckpointInfo:
    """Check a checkpoint directory's manifest, format version, sizes and checksums, that every
    file it names lies inside the directory, and that DCP's ``.metadata`` (a plain pickle) names
    nothing but what DCP writes (``untrusted.check_metadata``; nothing in it is run).

    Raises CheckpointError naming the file and the problem (missing, truncated, corrupt, newer
    format, outside the checkpoint, hostile).
    """
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        step = int(manifest["step"])
        version = int(manifest["format_version"])
        entries = dict(manifest["files"])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MANIFEST_FILE} "
                              "(its write never finished)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {str(manifest_path)!r} is damaged ({exc.__class__.__name__}: {exc})") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {version}, newer than this scaleloop "
                              f"reads ({FORMAT_VERSION}); upgrade scaleloop to resume it")
    if STATE_FILE not in entries:
        raise CheckpointError(f"checkpoint manifest {str(manifest_path)!r} does not list {STATE_FILE}, which every "
                              "scaleloop checkpoint holds; the checkpoint was not written by scaleloop or was tampered with")
    for name, entry in entries.items():
        file = _inside(path, name, manifest_path)
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing")
        size = file.stat().st_size
        if size != int(entry["bytes"]):
            raise CheckpointError(f"checkpoint file {str(file)!r} is truncated or damaged: {size} bytes, "
                                  f"the manifest says {entry['bytes']}")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt: its SHA-256 does not match the manifest")
    if (path / untrusted.METADATA_FILE).is_file():
        untrusted.check_metadata(_inside(path, untrusted.METADATA_FILE, manifest_path))
    return CheckpointInfo(path=path, step=step, meta=manifest)


def _inside(path: Path, name: Any, manifest_path: Path) -> Path:
    """``path / name`` for a file the manifest names; CheckpointError, before anything is opened,
    when ``name`` leads outside the checkpoint directory (``..``, an absolute path, a symbolic link)."""
    parts = Path(name).parts if isinstance(name, str) else ()
    file = path / name if parts else path
    if not parts or Path(name).is_absolute() or ".." in parts or not _resolves_inside(file, path):
        raise CheckpointError(f"checkpoint manifest {str(manifest_path)!r} names {str(name)[:80]!r}, which is not "
                              "a file inside its checkpoint directory; refusing it (nothing outside is read): "
                              "the checkpoint was not written by scaleloop or was tampered with")
    return file


def _resolves_inside(file: Path, directory: Path) -> bool:
    # A symbolic link anywhere on the way (the file or a folder in the checkpoint) may point out.
    try:
        file.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


def step_of(path: Path) -> int:
    """The step of a ``step-N`` checkpoint directory."""
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise ValueError(f"{str(path)!r} is not a step-N checkpoint directory")
    return int(m.group(1))


def retire_after(root: Path, step: int) -> list[Path]:
    """Move the checkpoints under ``root`` of steps after ``step`` aside, to ``.superseded-step-N-<ns>``
    (kept, not deleted; ignored by everything that looks for checkpoints). Returns the new paths."""
    moved = []
    for path in list_checkpoints(root):
        if step_of(path) > step:
            target = root / f".superseded-{path.name}-{time.time_ns()}"
            os.replace(path, target)
            moved.append(target)
    if moved:
        _fsync_dir(root)
    return moved


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories under ``root``, newest step first (unverified)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found, reverse=True)]


def newest_valid(root: Path, warn: Callable[[str], None]) -> Optional[CheckpointInfo]:
    """The newest checkpoint under ``root`` that verifies; each one skipped is reported via ``warn``."""
    for path in list_checkpoints(root):
        try:
            return verify_checkpoint(path)
        except CheckpointError as exc:
            warn(f"warning: skipping a bad checkpoint: {exc}")
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints, and temporary directories of dead writes."""
    removed = []
    for path in list_checkpoints(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for child in root.iterdir() if root.is_dir() else ():
        if child.name.startswith((".tmp-", ".old-")) and not child.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def locate(path: Path) -> Path:
    """The checkpoint directory that ``path`` names: a run directory, its ``checkpoints/``, a
    ``step-N`` directory, or the ``state.pt``/``manifest.json`` inside one.

    For a run or ``checkpoints/`` directory this is the newest one; it is not verified here.
    """
    if path.is_file() and path.name in (STATE_FILE, MANIFEST_FILE):
        return path.parent
    if (path / MANIFEST_FILE).exists() or _STEP_DIR.match(path.name):
        return path
    for root in (path / CHECKPOINTS_DIR, path):
        found = list_checkpoints(root)
        if found:
            return found[0]
    if not path.exists():
        raise CheckpointError(f"--resume {str(path)!r} does not exist")
    raise CheckpointError(f"--resume {str(path)!r} holds no checkpoint (expected a run directory, its "
                          f"{CHECKPOINTS_DIR}/, a step-N directory or a {STATE_FILE})")


def run_dir_of(checkpoint: Path) -> Optional[Path]:
    """The run directory a checkpoint belongs to (``<run>/checkpoints/step-N``), if it sits in one."""
    parent = checkpoint.parent
    return parent.parent if parent.name == CHECKPOINTS_DIR else None
