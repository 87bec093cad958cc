"""One process, one device: the plain loop, with nothing to synchronise."""
from __future__ import annotations

from scaleloop.strategies.base import HandWrittenLoop


class SingleDevice(HandWrittenLoop):
    """The model lives on one device; every default of ``Strategy`` already describes it."""

    name = "single"
