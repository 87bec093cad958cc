"""Parallelism applied in one place: the ranks' layout built once from the mesh, and the fixed order.

Every strategy holds a :class:`Parallelism`: the layout of the ranks as one
:class:`~scaleloop.runtime.mesh.MeshSpec` (the ``pp``, ``dp``, ``fsdp`` and ``tp`` sizes), this
rank's place in it, the data-parallel share it trains on, and whether activations are
recomputed. ``build_strategy`` builds it from the settings (:meth:`Parallelism.of`) and picks the
strategy class from it; the loader, the evaluation split and the process groups all read it.

:func:`parallelize` then makes the model parallel in one fixed order:

1. tensor parallelism over ``tp`` (the model's ``tp_plan()``), first: its layers are named as
   in the user's module, before any wrapper, and FSDP2 then shards the split weights over the
   data dimensions (torch's 2-D composition: tensor parallel inside, data parallel outside);
2. activation checkpointing of each block, in place (parameter names unchanged);
3. data parallelism over ``dp`` and ``fsdp``: FSDP2 (sharded, or replicated over ``dp`` in HSDP),
   DDP, a hand-written all-reduce, or for a pipeline the replicas' process groups;
4. the pipeline split over ``pp``: this rank keeps its stages.

The pipeline split comes last, where torchtitan splits first and then applies the rest to each
stage. Here a pipeline composes with ``dp`` only (``ParallelSettings.check_layout`` refuses pp
with fsdp or tp), and its data-parallel step wraps nothing: it builds the process groups that the
stages then talk and average gradients in. So cutting last gives the same stages, and the cut is
made from the whole model, whose parameter names every stage keeps for whole-model checkpoints.

A strategy supplies the steps (``_tensor_parallel``, ``_data_parallel``, ``_pipeline_split``) and
names the mesh dimensions it builds a ``DeviceMesh`` over (``_mesh_dims``); pipeline x dp and
fsdp x tp go through the same :class:`Parallelism` and the same order. docs/architecture.md,
"The flow of one run", step 8.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from scaleloop.runtime.mesh import MeshSpec

if TYPE_CHECKING:
    from torch import nn

    from scaleloop.runtime.dist import DistEnv
    from scaleloop.strategies.registry import ParallelSettings


@dataclass
class Parallelism:
    """The ranks' layout, this rank's place in it, and what :func:`parallelize` applies."""

    spec: MeshSpec
    rank: int = 0
    #: ``--activation-checkpointing``: each block recomputes its activations in the backward.
    recompute: bool = False
    #: Blocks checkpointed by :func:`parallelize` (0 until it ran).
    recomputed_blocks: int = 0
    #: What those blocks are and how they were found, in words (for the run's note).
    recomputed_what: str = ""
    _mesh: Any = field(default=None, repr=False)

    @classmethod
    def of(cls, settings: "ParallelSettings", world_size: int, rank: int) -> "Parallelism":
        """The parallelism of ``settings``, checked for ``world_size`` processes (``ParallelSettings.check_layout``),
        on ``rank``: ``--mesh`` as given; else every rank a pipeline stage (pipeline), a data shard
        (fsdp) or a data replica."""
        if settings.mesh is not None:
            spec = MeshSpec.parse(settings.mesh)
        elif settings.strategy == "pipeline":
            spec = MeshSpec(pp=world_size)
        elif settings.strategy == "fsdp":
            spec = MeshSpec(fsdp=world_size)
        else:
            spec = MeshSpec(dp=world_size)
        return cls(spec, rank, recompute=settings.activation_checkpointing)

    # --- where this rank sits -------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        """Each dimension's size, outermost first."""
        return self.spec.sizes

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along each dimension."""
        return self.spec.coordinates(self.rank)

    @property
    def data_world(self) -> int:
        """Ranks that train on different samples (``dp x fsdp``): a step's batch is split this many ways."""
        return self.spec.data_parallel

    @property
    def data_rank(self) -> int:
        """Which share of each batch this rank trains on (tp and pp ranks of one group share theirs)."""
        return self.spec.data_rank(self.rank)

    # --- the process groups ---------------------------------------------------------------
    def device_mesh(self, env: "DistEnv", dims: tuple[str, ...]) -> Any:
        """The ``DeviceMesh`` over ``dims`` (named, outermost first) on ``env``'s device, its groups
        bounded by ``env``'s ``--timeout``, built once: a collective, which every rank calls at the
        same point of set-up."""
        if self._mesh is None:
            self._mesh = self.spec.build(env.device.type, dims, timeout=env.group_timeout)
        return self._mesh

    def data_mesh(self, mesh: Any) -> Any:
        """The part of ``mesh`` the data-parallel step runs over: ``(dp, fsdp)`` (HSDP) when weights
        are replicated over ``dp``, else ``fsdp``."""
        return mesh["dp", "fsdp"] if self.spec.dp > 1 else mesh["fsdp"]

    def steps(self) -> list[str]:
        """What :func:`parallelize` applies, in its order, in words."""
        spec, out = self.spec, []
        if spec.tp > 1:
            out.append(f"tensor parallel over tp={spec.tp}")
        if self.recompute:
            out.append("activation checkpointing")
        data = [f"{d}={getattr(spec, d)}" for d in ("dp", "fsdp") if getattr(spec, d) > 1]
        if data:
            out.append(f"data parallel over {' x '.join(data)}")
        if spec.pp > 1:
            out.append(f"pipeline split over pp={spec.pp}")
        return out


def order_line(parallelism: Parallelism) -> list[str]:
    """The header's line naming what :func:`parallelize` applied, in its order (none for one step)."""
    steps = parallelism.steps()
    return [f"applied in this order: {', then '.join(steps)}"] if len(steps) > 1 else []


class Parallelizable(Protocol):
    """The steps a strategy supplies to :func:`parallelize` (``Strategy`` has do-nothing defaults)."""

    parallelism: Parallelism

    def _tensor_parallel(self, model: "nn.Module") -> None: ...

    def _data_parallel(self, model: "nn.Module") -> "nn.Module": ...

    def _pipeline_split(self, model: "nn.Module") -> "nn.Module": ...


def parallelize(model: "nn.Module", strategy: Parallelizable) -> "nn.Module":
    """``model`` (already on its device) made parallel by ``strategy``'s steps in the fixed order of
    the module docstring: tensor parallelism, activation checkpointing, data parallelism, the
    pipeline split. Returns what this rank trains (the wrapper, or its stages)."""
    parallelism = strategy.parallelism
    strategy._tensor_parallel(model)
    if parallelism.recompute:
        from scaleloop.strategies.recompute import checkpoint_found_blocks

        found = checkpoint_found_blocks(model)
        parallelism.recomputed_blocks = len(found)
        parallelism.recomputed_what = f"{found.describe()}, {found.source}"
    model = strategy._data_parallel(model)
    return strategy._pipeline_split(model)


def default_parallelism(world_size: int, rank: int, spec: Optional[MeshSpec] = None) -> Parallelism:
    """A strategy built without settings: every rank a data replica (or ``spec``)."""
    return Parallelism(spec if spec is not None else MeshSpec(dp=world_size), rank)
