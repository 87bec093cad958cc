"""``build_strategy``: a strategy built from the parallel settings (its registered name among them).

The settings are checked by ``ParallelSettings.check_layout`` (``strategies.registry``), the same
rules the CLI applies to a config, so a combination is refused in one place with one message.
"""
from __future__ import annotations

import importlib

from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import Strategy
from scaleloop.strategies.parallelize import Parallelism
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.registry import REGISTRY, ParallelSettings, resolve_strategy_name


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under ``name`` (imported now: torch)."""
    module, _, attr = REGISTRY[name].cls.partition(":")
    return getattr(importlib.import_module(module), attr)


def batch_split_of(described: str) -> str:
    """How a step's batch reaches the ranks (``Strategy.batch_split``) under the strategy that
    ``described`` names: a ``describe()`` text, which starts with the strategy's registered name."""
    name = described.split(" ", 1)[0]
    return strategy_class(name).batch_split if name in REGISTRY else Strategy.batch_split


def build_strategy(settings: ParallelSettings, env: DistEnv) -> Strategy:
    """The strategy of the parallel section ``settings`` on ``env``: checked for ``env``'s world
    size, its ``Parallelism`` built once (``strategies.parallelize``), and the class that runs it made
    from both, with ``settings.precision`` on ``env``'s device. The one way a strategy is built: the
    trainer hands it the config's section, ``scaleloop.strategy`` a section made of its keywords."""
    settings.check_layout(env.world_size)
    parallelism = Parallelism.of(settings, env.world_size, env.rank)
    precision = Precision(settings.precision, env.device)
    return strategy_class(class_for(settings, parallelism, env.is_distributed)).build(
        env, precision, settings, parallelism)


def class_for(settings: ParallelSettings, parallelism: Parallelism, distributed: bool) -> str:
    """The registered strategy that runs ``parallelism``: a pipeline whenever it has pipeline stages (``--mesh
    pp=S,dp=R`` too), the mesh strategy for any other ``--mesh``, else the one named."""
    if parallelism.spec.pp > 1:
        return "pipeline"
    if settings.mesh is not None:
        return "mesh"
    return resolve_strategy_name(settings.strategy, distributed)

