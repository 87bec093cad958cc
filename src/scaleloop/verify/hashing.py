"""SHA-256 digests of tensors, batches and module state: equal digests mean equal bytes."""
from __future__ import annotations

import hashlib
from typing import Any

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded ``DTensor`` (a collective: every rank must call it), else ``t``."""
    gather = getattr(t, "full_tensor", None)
    return gather() if callable(gather) else t


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sharded ``DTensor`` (FSDP's parameters), whose ranks hold parts of it."""
    return callable(getattr(t, "full_tensor", None))


def _update(h: "hashlib._Hash", obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # dtype and shape are part of the digest: the same bytes read as another dtype or
        # shape are not the same data.
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, (list, tuple)):
        h.update(f"seq{len(obj)}".encode())
        for item in obj:
            _update(h, item)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            h.update(str(key).encode())
            _update(h, obj[key])
    else:
        h.update(repr(obj).encode())


def digest(*objs: Any) -> str:
    """Hex SHA-256 of tensors (dtype, shape and bytes), nested lists/tuples/dicts of them, or reprs."""
    h = hashlib.sha256()
    for obj in objs:
        _update(h, obj)
    return h.hexdigest()
