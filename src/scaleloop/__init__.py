"""scaleloop: a plain PyTorch training loop, scaled from one CPU to many GPUs and machines.

The public API is re-exported here lazily, so that ``import scaleloop`` costs almost nothing
until a name is used.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DistEnv": "scaleloop.dist",
    "init_process_group": "scaleloop.dist",
    "destroy_process_group": "scaleloop.dist",
    "best_device": "scaleloop.devices",
    "resolve_device": "scaleloop.devices",
    "Precision": "scaleloop.precision",
    "Strategy": "scaleloop.strategies",
    "make_strategy": "scaleloop.strategies",
    "TrainConfig": "scaleloop.config",
    "train": "scaleloop.loop",
    "RunResult": "scaleloop.loop",
    "evaluate": "scaleloop.evaluate",
    "build_model": "scaleloop.models",
    "SimpleNet": "scaleloop.models",
    "BiggerNet": "scaleloop.models",
    "ConvNet": "scaleloop.models",
    "TinyGPT": "scaleloop.models",
    "build_datasets": "scaleloop.data.datasets",
    "RandomDataset": "scaleloop.data.datasets",
    "DataInfo": "scaleloop.data.info",
    "Datasets": "scaleloop.data.info",
    "UsageError": "scaleloop.errors",
    "shard_indices": "scaleloop.gather",
    "gather_tensor": "scaleloop.gather",
    "gather_padded": "scaleloop.gather",
    "sum_over_ranks": "scaleloop.gather",
    "find_max_batch": "scaleloop.tune",
    "search_max_batch": "scaleloop.tune",
    "BatchSearch": "scaleloop.tune",
    "Checkpointer": "scaleloop.checkpoint",
    "CheckpointError": "scaleloop.checkpoint",
    "launch": "scaleloop.spawn",
    "WorkerError": "scaleloop.spawn",
    "WorkerFailure": "scaleloop.spawn",
}

__all__ = sorted(_EXPORTS) + ["__version__", "strategy"]


def strategy(name: str, env: Any, precision: str = "fp32", accumulate: int = 1, *,
             sync_batchnorm: bool = False, microbatches: int = 1) -> Any:
    """Shorthand for ``make_strategy``: ``sl.strategy("ddp", env, precision="bf16")``,
    ``sl.strategy("pipeline", env, microbatches=4)``."""
    from scaleloop.strategies import make_strategy

    return make_strategy(name, env, precision, accumulate, sync_batchnorm, microbatches=microbatches)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop' has no attribute {name!r}")
