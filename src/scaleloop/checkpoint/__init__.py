"""Checkpoints: full training state, written atomically, verified on load, resumable anywhere.

- ``store``: the on-disk layout, atomic writes, manifests and checksums, pruning;
- ``state``: weights-only serialisation, RNG capture/restore, the model-shape check;
- ``resume``: which checkpoint ``--resume`` means, and which settings a resumed run keeps;
- ``manager``: :class:`Checkpointer`, which saves and restores through a strategy on every rank;
- ``replicas``: a verified copy of each checkpoint on every machine that does not share rank 0's disk.

Sharded (FSDP) state goes through ``scaleloop.strategies.distcp``.
"""
from scaleloop.checkpoint.manager import Checkpointer, Progress, Resumed
from scaleloop.checkpoint.store import CheckpointError, CheckpointInfo, verify_checkpoint

__all__ = ["Checkpointer", "Progress", "Resumed", "CheckpointError", "CheckpointInfo", "verify_checkpoint"]
