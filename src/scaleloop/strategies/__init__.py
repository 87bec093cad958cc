"""Strategies: how one training loop uses one device, several, or several machines.

- ``base``: the ``Strategy`` contract, and ``HandWrittenLoop``: the hand-written loop's calls;
  ``single``: one device; ``dataparallel``: ``nn.DataParallel``; ``ddp``: DistributedDataParallel;
  ``allreduce``: the gradient all-reduce written out by hand; ``fsdp``: FSDP2 sharding;
  ``pipeline``: layers cut into stages, one per process (or several: interleaved); ``composed``: ``--mesh``, tensor
  parallelism with FSDP or HSDP (``tensor``: a model's TP plan; the mesh itself is ``scaleloop.runtime.mesh``).
- ``precision``: autocast and the fp16 GradScaler; ``syncbn``: BatchNorm over all ranks on any
  device; ``distcp``: sharded state through ``torch.distributed.checkpoint``; ``recompute``:
  ``--activation-checkpointing``, each block's activations recomputed in the backward.
"""
from __future__ import annotations

from typing import Optional

from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.allreduce import ManualAllReduce
from scaleloop.strategies.composed import MeshParallel
from scaleloop.strategies.base import EvalShard, HandWrittenLoop, ProcessGroupStrategy, Strategy
from scaleloop.strategies.dataparallel import DataParallel
from scaleloop.strategies.ddp import DDP
from scaleloop.strategies.fsdp import FSDP
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.pipeline import PipelineParallel
from scaleloop.strategies.single import SingleDevice

__all__ = ["Strategy", "HandWrittenLoop", "ProcessGroupStrategy", "EvalShard", "SingleDevice", "DataParallel", "DDP",
           "ManualAllReduce", "FSDP", "PipelineParallel", "MeshParallel", "MeshSpec", "STRATEGY_CLASSES", "make_strategy", "resolve_strategy_name",
           "batch_split_of"]

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    "single": SingleDevice,
    "dp": DataParallel,
    "ddp": DDP,
    "allreduce": ManualAllReduce,
    "fsdp": FSDP,
    "pipeline": PipelineParallel,
    "mesh": MeshParallel,
}


def batch_split_of(described: str) -> str:
    """How a step's batch reaches the ranks (``Strategy.batch_split``) under the strategy that
    ``described`` names: a ``describe()`` text, which starts with the strategy's registered name."""
    return STRATEGY_CLASSES.get(described.split(" ", 1)[0], Strategy).batch_split


def resolve_strategy_name(name: str, env: DistEnv) -> str:
    """``auto`` becomes DDP when this job has several processes, else single-device."""
    if name == "auto":
        return "ddp" if env.is_distributed else "single"
    return name


def make_strategy(name: str, env: DistEnv, precision: Optional[Precision | str] = None,
                  accumulate: int = 1, sync_batchnorm: bool = False, *, microbatches: int = 1,
                  find_unused_parameters: bool = False, static_graph: bool = False,
                  mesh: Optional[MeshSpec | str] = None, cpu_offload: bool = False,
                  pipeline_schedule: str = "gpipe", stages_per_rank: int = 0,
                  sharded_checkpoints: bool = False) -> Strategy:
    """Build a strategy by name (``auto`` picks one for ``env``); ``microbatches``,
    ``pipeline_schedule`` (gpipe, 1f1b, interleaved), ``stages_per_rank`` and ``sharded_checkpoints``
    (each stage writes its own part) are the pipeline's,
    ``find_unused_parameters`` and ``static_graph`` are DDP's; ``mesh`` (``"dp=2,tp=2"`` or a
    ``MeshSpec``) builds the ``mesh`` strategy, which ``auto`` then means; ``cpu_offload`` is
    FSDP2's (fsdp and mesh)."""
    if isinstance(precision, str) or precision is None:
        precision = Precision(precision or "fp32", env.device)
    if mesh is not None or name == "mesh":
        if name not in ("auto", "mesh"):
            raise UsageError(f"--mesh lays out the ranks itself: drop --strategy {name} (or use --strategy mesh)")
        if mesh is None:
            raise UsageError("--strategy mesh needs the layout: add --mesh, e.g. --mesh dp=2,tp=2")
        spec = MeshSpec.parse(mesh) if isinstance(mesh, str) else mesh
        if find_unused_parameters or static_graph:
            raise UsageError("--find-unused-parameters and --static-graph do not apply to --mesh")
        if spec.pp > 1:   # pipeline x data parallel: each stage replicated dp times
            if spec.fsdp > 1 or spec.tp > 1:
                raise UsageError(f"--mesh {spec}: pp composes with dp only (pipeline x data parallel); drop fsdp/tp, "
                                 "or drop pp")
            spec.check(env.world_size)
            return PipelineParallel(env, precision, accumulate, sync_batchnorm, microbatches=microbatches,
                                    schedule=pipeline_schedule, stages_per_rank=stages_per_rank, replicas=spec.dp,
                                    sharded_checkpoints=sharded_checkpoints)
        if microbatches > 1 or pipeline_schedule != "gpipe" or stages_per_rank:
            raise UsageError("--microbatches, --pipeline-schedule and --stages-per-rank apply to pipelines: "
                             "--strategy pipeline or --mesh pp=N")
        return MeshParallel(env, precision, accumulate, sync_batchnorm, mesh=spec, cpu_offload=cpu_offload)
    concrete = resolve_strategy_name(name, env)
    cls = STRATEGY_CLASSES.get(concrete)
    if cls is None:
        raise UsageError(f"unknown strategy {name!r}; choose one of: auto, {', '.join(STRATEGY_CLASSES)}")
    if concrete in ("single", "dp") and env.is_distributed:
        raise UsageError(
            f"--strategy {concrete} runs one process, but this job has {env.world_size}; "
            "use --strategy ddp or allreduce")
    if cls is FSDP:
        return FSDP(env, precision, accumulate, sync_batchnorm, cpu_offload=cpu_offload)
    if cpu_offload:
        raise UsageError(f"cpu_offload moves FSDP's shards to host memory: use it with fsdp or mesh, not {concrete}")
    if cls is PipelineParallel:
        return PipelineParallel(env, precision, accumulate, sync_batchnorm, microbatches=microbatches,
                                schedule=pipeline_schedule, stages_per_rank=stages_per_rank,
                                sharded_checkpoints=sharded_checkpoints)
    if pipeline_schedule != "gpipe" or stages_per_rank:
        raise UsageError(f"pipeline_schedule and stages_per_rank apply to the pipeline strategy only, not {concrete}")
    if microbatches > 1:
        raise UsageError(f"microbatches={microbatches} applies to the pipeline strategy only; use accumulate "
                         f"to split a step's batch with {concrete}")
    if cls is DDP:
        return DDP(env, precision, accumulate, sync_batchnorm, find_unused_parameters=find_unused_parameters,
                   static_graph=static_graph)
    if (find_unused_parameters or static_graph) and name != "auto":  # auto on one process: no DDP, nothing to tune
        raise UsageError(f"find_unused_parameters and static_graph are options of DistributedDataParallel: use them "
                         f"with the ddp strategy, not {concrete}")
    return cls(env, precision, accumulate, sync_batchnorm)
