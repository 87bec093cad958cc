"""``make_strategy``: a strategy built from its registered name and the parallel settings.

The settings are checked by ``ParallelSettings.check_layout`` (``strategies.registry``), the same
rules the CLI applies to a config, so a combination is refused in one place with one message.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.mesh import MeshSpec
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


def make_strategy(name: str, env: DistEnv, precision: Optional[Precision | str] = None,
                  accumulate: int = 1, sync_batchnorm: bool = False, *, microbatches: int = 1,
                  find_unused_parameters: bool = False, static_graph: bool = False,
                  mesh: Optional[MeshSpec | str] = None, cpu_offload: bool = False,
                  pipeline_schedule: str = "gpipe", stages_per_rank: int = 0,
                  sharded_checkpoints: bool = False, activation_checkpointing: bool = False) -> Strategy:
    """Build a strategy by name (``auto`` picks one for ``env``); ``microbatches``,
    ``pipeline_schedule`` (gpipe, 1f1b, interleaved), ``stages_per_rank`` and ``sharded_checkpoints``
    (each stage writes its own part) are the pipeline's,
    ``find_unused_parameters`` and ``static_graph`` are DDP's; ``mesh`` (``"dp=2,tp=2"`` or a
    ``MeshSpec``) builds the ``mesh`` strategy, which ``auto`` then means; ``cpu_offload`` is
    FSDP2's (fsdp and mesh); ``activation_checkpointing`` recomputes each block's activations in
    the backward (applied by ``setup`` after tensor parallelism, before data parallelism)."""
    if isinstance(precision, str) or precision is None:
        precision = Precision(precision or "fp32", env.device)
    settings = ParallelSettings(
        strategy=name, world_size=env.world_size, mesh=None if mesh is None else str(mesh), accumulate=accumulate,
        microbatches=microbatches, pipeline_schedule=pipeline_schedule, stages_per_rank=stages_per_rank,
        sync_batchnorm=sync_batchnorm, find_unused_parameters=find_unused_parameters, static_graph=static_graph,
        cpu_offload=cpu_offload, sharded_checkpoints=sharded_checkpoints,
        activation_checkpointing=activation_checkpointing)
    return build_strategy(settings, env, precision)


def build_strategy(settings: ParallelSettings, env: DistEnv, precision: Precision) -> Strategy:
    """The strategy of the parallel section ``settings`` on ``env``: checked, its ``Parallelism`` built once
    (``strategies.parallelize``), and the class that runs it made from both."""
    settings = dataclasses.replace(settings, world_size=env.world_size)
    settings.check_layout()
    parallelism = Parallelism.of(settings, env.rank)
    return strategy_class(class_for(settings, parallelism, env.is_distributed)).build(env, precision, settings,
                                                                                        parallelism)


def class_for(settings: ParallelSettings, parallelism: Parallelism, distributed: bool) -> str:
    """The registered strategy that runs ``parallelism``: a pipeline whenever it has pipeline stages (``--mesh
    pp=S,dp=R`` too), the mesh strategy for any other ``--mesh``, else the one named."""
    if parallelism.spec.pp > 1:
        return "pipeline"
    if settings.mesh is not None:
        return "mesh"
    return resolve_strategy_name(settings.strategy, distributed)

