"""The global-batch rule, shared by the config check and the library's loaders and strategies (no torch here)."""
from __future__ import annotations

from scaleloop.errors import UsageError


def check_batch_split(batch_size: int, world_size: int, accumulate: int) -> int:
    """Per-device micro-batch size for a GLOBAL ``batch_size``; UsageError naming valid choices.

    per-device batch = global batch / (world size x accumulation steps), and it must be whole.
    """
    pieces = world_size * accumulate
    if batch_size < 1 or batch_size % pieces:
        below = (batch_size // pieces) * pieces
        options = f"{below} or {below + pieces}" if below > 0 else str(pieces)
        raise UsageError(
            f"--batch-size {batch_size} does not split into {world_size} worker(s) x {accumulate} "
            f"accumulation step(s) = {pieces} equal micro-batches; use a multiple of {pieces}, "
            f"such as {options}")
    return batch_size // pieces
