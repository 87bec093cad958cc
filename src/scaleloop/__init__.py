"""scaleloop: a plain PyTorch training loop, scaled from one CPU to many GPUs and machines.

The public API is re-exported here lazily, so that ``import scaleloop`` costs almost nothing
until a name is used. The map:

- The floors, top first (docs/architecture.md): ``cli`` and ``commands``: the command, one
  module per subcommand; ``verify``, ``bench`` and ``plan``: the tools built on training, and
  ``sampling``: text from a trained language model (``scaleloop.sample``); ``launching``:
  starting workers and reading how they ended; ``ray``: training in Ray Train's workers
  (``scaleloop.ray.train``, an optional extra); ``loop``: the run and its loop; ``strategies``:
  single, dp, ddp, allreduce, fsdp, pipeline, mesh, and precision; ``checkpoint``: save and
  resume; ``config``: ``TrainConfig``; ``data``: datasets, samplers, loaders; ``models``: the
  built-in models; ``hfconfig``: a causal language model from a transformers ``config.json``; ``output``: what a run writes and prints; ``runtime``: the ground floor, this
  process (``DistEnv``, devices, collectives); ``plugins``: user code as ``pkg.module:factory``;
  ``errors``: ``UsageError``; ``option``: a setting's one declaration (default, help, choices),
  which every config section uses; ``__main__``: ``python -m scaleloop``.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DistEnv": "scaleloop.runtime.dist",
    "init_process_group": "scaleloop.runtime.dist",
    "destroy_process_group": "scaleloop.runtime.dist",
    "best_device": "scaleloop.runtime.devices",
    "resolve_device": "scaleloop.runtime.devices",
    "Precision": "scaleloop.strategies.precision",
    "Strategy": "scaleloop.strategies",
    "TrainConfig": "scaleloop.config",
    "train": "scaleloop.loop.training",
    "RunResult": "scaleloop.loop.result",
    "evaluate": "scaleloop.loop.evaluation",
    "build_model": "scaleloop.models",
    "SimpleNet": "scaleloop.models",
    "BiggerNet": "scaleloop.models",
    "ConvNet": "scaleloop.models",
    "TinyGPT": "scaleloop.models",
    "build_datasets": "scaleloop.data.datasets",
    "RandomDataset": "scaleloop.data.datasets",
    "DataInfo": "scaleloop.data.info",
    "DictTensorDataset": "scaleloop.data.batch",
    "call_model": "scaleloop.data.batch",
    "move": "scaleloop.data.batch",
    "Datasets": "scaleloop.data.info",
    "UsageError": "scaleloop.errors",
    "shard_indices": "scaleloop.runtime.collectives",
    "gather_tensor": "scaleloop.runtime.collectives",
    "gather_padded": "scaleloop.runtime.collectives",
    "sum_over_ranks": "scaleloop.runtime.collectives",
    "profile": "scaleloop.loop.profiler",
    "Profiler": "scaleloop.loop.profiler",
    "sample": "scaleloop.sampling",
    "find_max_batch": "scaleloop.plan.tune",
    "search_max_batch": "scaleloop.plan.tune",
    "BatchSearch": "scaleloop.plan.tune",
    "Checkpointer": "scaleloop.checkpoint",
    "CheckpointError": "scaleloop.checkpoint",
    "launch": "scaleloop.launching.spawn",
    "WorkerError": "scaleloop.launching.spawn",
    "WorkerFailure": "scaleloop.launching.spawn",
}

__all__ = sorted(_EXPORTS) + ["__version__", "strategy"]


def strategy(name: str, env: Any, **options: Any) -> Any:
    """A strategy by name on ``env``: ``sl.strategy("ddp", env, precision="bf16", accumulate=2)``,
    ``sl.strategy("pipeline", env, microbatches=4, pipeline_schedule="1f1b")``,
    ``sl.strategy("mesh", env, mesh="dp=2,tp=2")``. ``options`` are the fields of the config's
    parallel section (``scaleloop.strategies.ParallelSettings``: ``precision``, ``accumulate``,
    ``sync_batchnorm``, ...), whose defaults are ``scaleloop train``'s; ``auto`` picks ddp for a
    distributed ``env``, else single. Built by ``build_strategy``, as the trainer builds its own."""
    from scaleloop.strategies.factory import build_strategy
    from scaleloop.strategies.registry import ParallelSettings

    return build_strategy(ParallelSettings(strategy=name, **options), env)


def __dir__() -> list[str]:
    """The public API (``__all__``) and the module's own dunders: the lazily exported names are
    not attributes until first used, so without this ``dir`` and tab completion would hide them."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__") and name.endswith("__"))})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop' has no attribute {name!r}")
