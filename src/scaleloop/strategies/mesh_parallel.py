"""``--mesh``: data parallelism (replicated ``dp``, sharded ``fsdp``) composed with tensor parallelism (``tp``).

One strategy for every layout a :class:`~scaleloop.runtime.mesh.MeshSpec` names, built the
way torchtitan builds it: first the model's ``tp_plan()`` splits its layers over the ``tp``
dimension (``parallelize_module``), then FSDP2's ``fully_shard`` shards every unit over the
data-parallel dimensions: over ``fsdp`` alone (FSDP x TP), or over the 2-D ``(dp, fsdp)`` mesh
(HSDP: replicated over ``dp``, sharded within each ``fsdp`` group; ``fsdp=1`` is plain
replication, gradients all-reduced like DDP's). Each batch is split over the ``dp x fsdp``
ranks; the ``tp`` ranks of a group train on the same samples. docs/strategies.md, "--mesh".
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from scaleloop.data.sampler import split_sizes
from scaleloop.errors import UsageError
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.mesh import DIMS, MeshSpec
from scaleloop.strategies.base import EvalShard
from scaleloop.strategies.fsdp import FSDP
from scaleloop.strategies.parallelize import Parallelism, default_parallelism, order_line
from scaleloop.strategies.precision import Precision

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings


class MeshParallel(FSDP):
    """FSDP2's step over a mesh: TP over ``tp``, then FSDP2 over ``fsdp`` or HSDP over ``(dp, fsdp)``
    (the steps of its ``Parallelism``, applied by ``strategies.parallelize``); see the module docstring."""

    name = "mesh"
    batch_split = "split evenly over the dp x fsdp ranks (tp ranks share theirs)"
    _mesh_dims = DIMS   # every dimension named (size 1 too): mesh["dp", "fsdp"] exists in every layout
    _shards_what = "--mesh shards and splits"

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings",
              parallelism: Parallelism) -> "MeshParallel":
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                   cpu_offload=settings.cpu_offload, one_unit=settings.find_unused_parameters)

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, mesh: Optional[MeshSpec] = None,
                 parallelism: Optional[Parallelism] = None, cpu_offload: bool = False, one_unit: bool = False) -> None:
        if parallelism is None:
            parallelism = default_parallelism(env.world_size, env.rank, mesh if mesh is not None else MeshSpec(fsdp=env.world_size))
        super().__init__(env, precision, accumulate, sync_batchnorm, parallelism=parallelism, cpu_offload=cpu_offload,
                         one_unit=one_unit)

    @property
    def spec(self) -> MeshSpec:
        """The mesh (``parallelism.spec``)."""
        return self.parallelism.spec

    def _check(self) -> None:
        super()._check()
        self.spec.check(self.env.world_size)
        if self.spec.pp > 1:
            raise UsageError(f"--mesh {self.spec}: a mesh with pp runs as a pipeline (pp x dp only): build it with "
                             "scaleloop.strategy('mesh', env, mesh=...), which picks the pipeline strategy")
        if self._sync_batchnorm:
            raise UsageError("--sync-batchnorm is not offered with --mesh; use --strategy ddp or fsdp")

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        return self.parallelism.coordinates

    def _check_stream(self) -> None:
        raise UsageError("--mesh reads map-style datasets (with __len__ and indexing); a stream is not "
                         "split over mesh dimensions yet: use --strategy fsdp")

    # --- one step -----------------------------------------------------------------------
    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The norm of the whole gradient, computed per parameter: the gradients are DTensors on
        different meshes (split layers on ``(data, tp)``, the rest on the data mesh alone), which
        ``get_total_norm`` cannot combine in one call."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = [_whole(torch.linalg.vector_norm(g.float())) ** 2 for g in grads]
        return torch.stack(squares).sum().sqrt() if squares else torch.zeros((), device=self.env.device)

    # --- evaluation ---------------------------------------------------------------------
    def eval_shard(self, n: int, batch_size: int) -> EvalShard:
        # Split over the data-parallel ranks; a tp group's ranks run the same forwards (each
        # forward is a collective over tp and, for FSDP, over the data ranks).
        sizes = split_sizes(n, self.spec.data_parallel)
        share = self.parallelism.data_rank
        start = sum(sizes[:share])
        own = math.ceil(sizes[share] / batch_size)
        return EvalShard(range(start, start + sizes[share]), max(gather_object(own, self.env)) - own)

    def eval_forward(self, model: nn.Module, x: Any) -> Any:
        out = super().eval_forward(model, x)
        # The tp ranks of a group hold the same outputs: only the first one's are counted.
        return out if self.coordinates["tp"] == 0 else None

    # --- what a run prints --------------------------------------------------------------
    def composition(self) -> str:
        """The composition in words: ``tp``, ``fsdp x tp``, ``hsdp``, ``hsdp x tp``, ..."""
        dp, fsdp, tp = self.spec.dp, self.spec.fsdp, self.spec.tp
        data = "hsdp" if dp > 1 and fsdp > 1 else "replicated" if dp > 1 else "fsdp" if fsdp > 1 else ""
        return " x ".join(part for part in (data, "tp" if tp > 1 else "") if part) or "one rank"

    def _parted_words(self) -> dict[str, str]:
        return {"who": f"--mesh {self.spec}",
                "fix": "add --find-unused-parameters (the whole model is then one unit, which every rank runs)",
                "remedy": ""}

    def describe(self) -> str:
        """``mesh fsdp=2,tp=2 (fsdp x tp, 5 units: 4 x LlamaDecoderLayer + root, 30 tp layers)``: the
        units named as fsdp's line names them, and how many layers tensor parallelism split."""
        offload = ", cpu offload" if self.cpu_offload else ""
        which = f"{self._unit_classes} + root" if self._unit_classes else "root"
        units = ("1 unit: the whole model, --find-unused-parameters" if self.one_unit
                 else f"{self.units} unit{'s' if self.units != 1 else ''}: {which}")
        return f"mesh {self.spec} ({self.composition()}, {units}, {self.tp_layers} tp layers{offload})"

    def details(self) -> list[str]:
        return self.spec.draw() + order_line(self.parallelism)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor reduction's value as a plain tensor (the same on every rank); else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
