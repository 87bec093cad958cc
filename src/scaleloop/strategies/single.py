"""One process, one device: the plain loop, with nothing to synchronise."""
from __future__ import annotations

from scaleloop.strategies.base import Strategy


class SingleDevice(Strategy):
    """The model lives on one device; every default of ``Strategy`` already describes it."""

    name = "single"
