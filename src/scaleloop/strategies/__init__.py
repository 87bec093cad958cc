"""Strategies: how one training loop uses one device, several, or several machines.

- ``registry``: every strategy registered once (name, class, processes, and what the CLI, the
  option checks, ``scaleloop env`` and bench know of it: every list of strategies is read from it),
  and ``ParallelSettings``: the config's parallel section and the one place its combinations are
  checked (no torch); a new strategy is its module and one entry there (docs/strategies.md,
  "Adding a strategy");
  ``factory``: ``build_strategy``, the one way a strategy is built: from those settings;
  ``parallelize``: the ``Parallelism`` built once from the mesh (sizes, this rank's coordinates,
  data rank and data world size, the one ``DeviceMesh``), and ``parallelize``, which applies it in
  one fixed order: tensor parallelism, activation checkpointing, data parallelism, pipeline split.
- ``base``: the ``Strategy`` contract, and ``HandWrittenLoop``: the hand-written loop's calls;
  ``single``: one device; ``dataparallel``: ``nn.DataParallel``; ``ddp``: DistributedDataParallel;
  ``allreduce``: the gradient all-reduce written out by hand; ``fsdp``: FSDP2 sharding;
  ``pipeline``: layers cut into stages, one per process (or several: interleaved), and
  ``pipeline_schedules``: how a micro-step is cut into pieces and which schedules run them, and
  ``hf_stages``: a transformers decoder-only causal LM as the pipeline's layers, cut at its blocks;
  ``fault_tolerant``: ``--replica-groups``, DDP in each group and torchft between groups;
  ``mesh_parallel``: ``--mesh``, tensor parallelism with FSDP or HSDP (``tensor``: a model's TP plan;
  the mesh itself is ``scaleloop.runtime.mesh``).
- ``precision``: autocast and the fp16 GradScaler; ``syncbn``: BatchNorm over all ranks on any
  device; ``distcp``: sharded state through ``torch.distributed.checkpoint``; ``recompute``:
  ``--activation-checkpointing``, each block's activations recomputed in the backward; ``blocks``:
  which modules are a model's blocks (FSDP's units, the recomputed ones); ``unused``: parameters
  that get no gradient in a step, trained as one process trains them (the rule, and the
  all-reduce that tells the ranks which); ``fsdp_agreement``: FSDP's ranks checked to run the same
  units; ``repoint``: an optimizer object given to ``setup`` moved onto the parameters it made.

Names are imported lazily: the config reads ``registry`` without importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Strategy": "scaleloop.strategies.base",
    "HandWrittenLoop": "scaleloop.strategies.base",
    "ProcessGroupStrategy": "scaleloop.strategies.base",
    "EvalShard": "scaleloop.strategies.base",
    "SingleDevice": "scaleloop.strategies.single",
    "DataParallel": "scaleloop.strategies.dataparallel",
    "DDP": "scaleloop.strategies.ddp",
    "ManualAllReduce": "scaleloop.strategies.allreduce",
    "FSDP": "scaleloop.strategies.fsdp",
    "PipelineParallel": "scaleloop.strategies.pipeline",
    "MeshParallel": "scaleloop.strategies.mesh_parallel",
    "MeshSpec": "scaleloop.runtime.mesh",
    "Precision": "scaleloop.strategies.precision",
    "build_strategy": "scaleloop.strategies.factory",
    "Parallelism": "scaleloop.strategies.parallelize",
    "batch_split_of": "scaleloop.strategies.factory",
    "ParallelSettings": "scaleloop.strategies.registry",
    "REGISTRY": "scaleloop.strategies.registry",
    "PRECISIONS": "scaleloop.strategies.registry",
    "STRATEGIES": "scaleloop.strategies.registry",
    "resolve_strategy_name": "scaleloop.strategies.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop.strategies' has no attribute {name!r}")
