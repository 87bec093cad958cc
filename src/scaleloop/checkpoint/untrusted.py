"""Reading the pickle-shaped files of a checkpoint without ever running code from them.

A checkpoint directory may come from anyone: a colleague, a download, a shared disk. A pickle
rebuilds objects by calling whatever functions the file names, so an unchecked pickle is a
program. A scaleloop checkpoint holds two kinds:

- ``torch.save`` files (``state.pt``, DCP's ``__<rank>_0.distcp`` tensors and byte entries):
  read with ``torch.load(weights_only=True)``, PyTorch's own restricted unpickler (tensors and
  plain values only; see ``checkpoint.state`` and ``strategies.distcp``);
- DCP's ``.metadata``, which ``torch.distributed.checkpoint`` writes and reads with plain
  ``pickle``: read here instead, by an unpickler that resolves only the names DCP's metadata is
  made of (:data:`ALLOWED`) and refuses every other one before anything is called.

:func:`check_metadata` runs the same unpickler with inert stand-ins for the allowed names, so
``scaleloop doctor`` and the manifest check can refuse a hostile file without importing torch.
This module imports no torch; :func:`load_metadata` imports the allowed classes when it meets them.
"""
from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any, Callable

from scaleloop.errors import CheckpointError

#: DCP's metadata file in a sharded checkpoint.
METADATA_FILE = ".metadata"

#: The globals a ``.metadata`` file may name: DCP's metadata dataclasses, ``torch.Size``, dtypes
#: (:data:`DTYPES`), the layout helper, and the path DCP records it was written to.
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _Inert:
    """Stands for an allowed class or function while a file is only checked: takes any
    arguments and any state, and does nothing with them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


#: torch's dtypes, which a pickle names as ``torch.<name>`` (torch 2.13's list; a later torch's
#: new dtype is refused by name until added here).
DTYPES = frozenset(
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 "
    "complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 "
    "int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 "
    "uint4 uint5 uint6 uint64 uint7 uint8".split())


class _Restricted(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED` names (``resolve`` turns one into the
    object to use) and raises :class:`_Refused` naming any other."""

    def __init__(self, data: bytes, resolve: Callable[[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or (module == "torch" and name in DTYPES):
            return self._resolve(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent reference ({str(pid)[:40]})")


class _Refused(Exception):
    """A name the file asks for that is not allowed."""


def _real(module: str, name: str) -> Any:
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        raise _Refused(f"{module}.{name}")
    if module == "torch" and name != "Size":
        import torch

        if not isinstance(obj, torch.dtype):
            raise _Refused(f"{module}.{name}")
    return obj


def _unpickle(path: Path, resolve: Callable[[str, str], Any]) -> Any:
    """``path`` unpickled with :class:`_Restricted`; CheckpointError naming the file when it asks
    for anything else or is not a pickle."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        return _Restricted(data, resolve).load()
    except _Refused as exc:
        raise CheckpointError(f"refusing to load {str(path)!r}: it asks to run or build {exc}, which "
                              "torch.distributed.checkpoint's metadata never holds; this file was not written "
                              "by scaleloop or was tampered with (nothing in it was run)") from None
    except Exception as exc:   # any malformed pickle: truncated, wrong opcodes, wrong arguments
        detail = " ".join(str(exc).split())[:160]
        raise CheckpointError(f"{str(path)!r} cannot be read as torch.distributed.checkpoint metadata "
                              f"({exc.__class__.__name__}: {detail})") from None


def check_metadata(path: Path) -> None:
    """CheckpointError naming ``path`` (a DCP ``.metadata``) when it names anything but the
    allowed types, or is not a pickle. Nothing is called or imported: allowed names are stand-ins."""
    _unpickle(path, lambda module, name: _Inert)


def load_metadata(path: Path) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` in ``path``, read by the restricted
    unpickler; CheckpointError naming the file when it holds anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _unpickle(path, _real)
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{str(path)!r} is not torch.distributed.checkpoint metadata "
                              f"(it holds a {type(metadata).__name__})")
    return metadata
