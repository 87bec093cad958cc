"""Strategies: how one training loop uses one device, several, or several machines."""
from __future__ import annotations

from typing import Optional

from scaleloop.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.precision import Precision
from scaleloop.strategies.base import Strategy
from scaleloop.strategies.single import SingleDevice

__all__ = ["Strategy", "SingleDevice", "make_strategy", "resolve_strategy_name"]


def resolve_strategy_name(name: str, env: DistEnv) -> str:
    """``auto`` becomes a concrete strategy for this environment."""
    if name == "auto":
        return "single"
    return name


def make_strategy(name: str, env: DistEnv, precision: Optional[Precision | str] = None,
                  accumulate: int = 1) -> Strategy:
    """Build a strategy by name (``auto`` picks one for ``env``)."""
    if isinstance(precision, str) or precision is None:
        precision = Precision(precision or "fp32", env.device)
    concrete = resolve_strategy_name(name, env)
    if concrete == "single":
        if env.is_distributed:
            raise UsageError(
                f"--strategy single runs one process, but this job has {env.world_size}; "
                "use a data-parallel strategy or launch one process")
        return SingleDevice(env, precision, accumulate)
    raise UsageError(f"unknown strategy {name!r}; choose one of: auto, single")
