"""Checkpoints: full training state, written atomically, verified on load, resumable anywhere.

- ``settings``: ``CheckpointSettings``, the config's checkpoint section, and its checks;
- ``store``: the on-disk layout, atomic writes, manifests and checksums, pruning;
- ``untrusted``: DCP's ``.metadata`` read by a restricted unpickler (a checkpoint never runs code);
- ``state``: weights-only serialisation, RNG capture/restore, the model-shape check;
- ``resume``: which checkpoint ``--resume`` means, and which settings a resumed run keeps;
- ``claim``: the run directory claimed once (checked, locked, continued or not), by the launcher or rank 0;
- ``manager``: :class:`Checkpointer`, which saves and restores through a strategy on every rank;
- ``writing``: the writing rank's files of one checkpoint, and the one line when they cannot be written;
- ``background``: ``--async-checkpoint``'s writer thread and the host copy it writes from;
- ``weights``: the final weights as ``model.safetensors``, and weights read back (``--init-from``,
  ``scaleloop sample``) from safetensors, a transformers directory, a run or ``model.pt``, never running code;
- ``replicas``: a verified copy of each checkpoint on every machine that does not share rank 0's disk.

Sharded (FSDP) state goes through ``scaleloop.strategies.distcp``.
Names are imported lazily: reading a run directory (``scaleloop doctor``) imports no torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "scaleloop.checkpoint.manager",
    "Progress": "scaleloop.checkpoint.manager",
    "Resumed": "scaleloop.checkpoint.manager",
    "CheckpointError": "scaleloop.checkpoint.store",
    "CheckpointInfo": "scaleloop.checkpoint.store",
    "verify_checkpoint": "scaleloop.checkpoint.store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop.checkpoint' has no attribute {name!r}")
