"""Hostile checkpoint files for the tests: pickles that run code when loaded, and the manifest
rewritten to match them (the manifest's SHA-256 is a check against damage, not a signature)."""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any


class Payload:
    """Pickles as a call that creates ``marker``: loading it with plain pickle runs that call."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def payload_bytes(marker: Path) -> bytes:
    """A whole pickle of a :class:`Payload`."""
    return pickle.dumps(Payload(marker))


def rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``checkpoint/name`` and give the manifest that file's size and SHA-256."""
    (checkpoint / name).write_bytes(data)
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1))


def name_in_manifest(checkpoint: Path, name: str) -> None:
    """Add ``name`` (any string: ``../x``, ``/etc/shadow``) to the manifest, as a 0-byte file."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1))


def payload_in_byte_entries(checkpoint: Path, marker: Path) -> int:
    """Put a torch.save'd :class:`Payload` in place of every byte entry (non-tensor value: the
    optimizer's hyperparameters) of the DCP files in ``checkpoint``, with ``.metadata`` and the
    manifest rewritten to match. Returns how many entries were replaced."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from scaleloop.checkpoint.untrusted import load_metadata

    metadata = load_metadata(checkpoint / ".metadata")
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    grown: dict[str, bytes] = {}
    replaced = 0
    for index, info in list(metadata.storage_data.items()):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        data = grown.get(info.relative_path, (checkpoint / info.relative_path).read_bytes())
        grown[info.relative_path] = data + blob.getvalue()
        info.offset, info.length = len(data), len(blob.getvalue())
        replaced += 1
    for name, data in grown.items():
        rewrite(checkpoint, name, data)
    rewrite(checkpoint, ".metadata", pickle.dumps(metadata))
    return replaced
