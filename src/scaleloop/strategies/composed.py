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
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.data.sampler import split_sizes
from scaleloop.errors import UsageError
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import EvalShard
from scaleloop.strategies.blocks import _has_params, fsdp_blocks, untied_units
from scaleloop.strategies.fsdp import FSDP
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.tensor import apply_tensor_parallel, fsdp_placement

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings


class MeshParallel(FSDP):
    """TP over ``tp``, then FSDP2 over ``fsdp`` or HSDP over ``(dp, fsdp)``: see the module docstring."""

    name = "mesh"
    batch_split = "split evenly over the dp x fsdp ranks (tp ranks share theirs)"

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings") -> Union["MeshParallel", Any]:
        """The mesh's strategy; with a ``pp`` dimension, a pipeline whose stages are replicated ``dp`` times."""
        if settings.pipeline_layout() is not None:
            from scaleloop.strategies.pipeline import PipelineParallel

            return PipelineParallel.build(env, precision, settings)
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm,
                   mesh=MeshSpec.parse(settings.mesh or ""), cpu_offload=settings.cpu_offload)

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, mesh: MeshSpec, cpu_offload: bool = False) -> None:
        self.spec = mesh
        self.mesh: Any = None          # the DeviceMesh, once setup() built it
        self.tp_layers = 0
        self._blocks: list[nn.Module] = []   # FSDP's units, found before TP replaces parameters
        super().__init__(env, precision, accumulate, sync_batchnorm, cpu_offload=cpu_offload)

    def _check(self) -> None:
        super()._check()
        self.spec.check(self.env.world_size)
        if self.spec.pp > 1:
            raise UsageError(f"--mesh {self.spec}: a mesh with pp runs as a pipeline (pp x dp only): build it with "
                             "make_strategy('mesh', env, mesh=...), which picks the pipeline strategy")
        if self._sync_batchnorm:
            raise UsageError("--sync-batchnorm is not offered with --mesh; use --strategy ddp or fsdp")

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        return self.spec.coordinates(self.env.rank)

    # --- set-up -------------------------------------------------------------------------
    def _tensor_parallel(self, model: nn.Module) -> None:
        """Every rank from rank 0's weights, then the TP plan's layers split over the mesh's ``tp``."""
        if not _has_params(model):
            raise UsageError(f"--mesh shards and splits a model's parameters, and {type(model).__name__} has none; "
                             "use --strategy ddp or single")
        self._ensure_process_group()
        if self.env.is_distributed:   # every rank starts from rank 0's weights (as FSDP and DDP do)
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    torch_dist.broadcast(tensor, src=0)
        self._blocks = untied_units(model, fsdp_blocks(model))   # found before TP replaces parameters
        self.mesh = self.spec.build(self.env.device.type)
        self.tp_layers = apply_tensor_parallel(model, self.mesh["tp"])

    def _wrap(self, model: nn.Module) -> nn.Module:
        """FSDP2 over the data dimensions of the mesh (what TP left of it), innermost units first."""
        from torch.distributed.fsdp import fully_shard

        blocks = self._blocks
        data_mesh = self.mesh["dp", "fsdp"] if self.spec.dp > 1 else self.mesh["fsdp"]
        block_ids = {id(b) for b in blocks}
        self.units = 0
        units: dict[str, nn.Module] = {}
        for name, module in reversed(list(model.named_modules())):   # innermost units first
            if module is not model and id(module) in block_ids:
                fully_shard(module, mesh=data_mesh, mp_policy=self._policy(), shard_placement_fn=fsdp_placement,
                            offload_policy=self._offload())
                units[name] = module
                self.units += 1
        fully_shard(model, mesh=data_mesh, mp_policy=self._policy(), shard_placement_fn=fsdp_placement,
                            offload_policy=self._offload())
        self.units += 1
        self._watch_gradients(model, units)   # parameters without a gradient, and the units' order: as fsdp
        return model

    @property
    def layout(self) -> MeshSpec:
        """The mesh itself: the batch is split over ``dp x fsdp``; a tp group's ranks load the same samples."""
        return self.spec

    def _check_stream(self) -> None:
        raise UsageError("--mesh reads map-style datasets (with __len__ and indexing); a stream is not "
                         "split over mesh dimensions yet: use --strategy fsdp")

    # --- one step -----------------------------------------------------------------------
    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The norm of the whole gradient, computed per parameter: the gradients are DTensors on
        different meshes (split layers on ``(data, tp)``, the rest on the data mesh alone), which
        ``clip_grad_norm_`` cannot combine in one call."""
        self.precision.unscale_(optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = [_whole(torch.linalg.vector_norm(g.float())) ** 2 for g in grads]
        total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), device=self.env.device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # clip_grad_norm_'s rule
        with torch.no_grad():
            for g in grads:
                g.mul_(float(coef))
        return total

    # --- evaluation ---------------------------------------------------------------------
    def eval_shard(self, n: int, batch_size: int) -> EvalShard:
        # Split over the data-parallel ranks; a tp group's ranks run the same forwards (each
        # forward is a collective over tp and, for FSDP, over the data ranks).
        sizes = split_sizes(n, self.spec.data_parallel)
        share = self.spec.data_rank(self.env.rank)
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

    def describe(self) -> str:
        offload = ", cpu offload" if self.cpu_offload else ""
        return f"mesh {self.spec} ({self.composition()}, {self.units} units, {self.tp_layers} tp layers{offload})"

    def details(self) -> list[str]:
        return self.spec.draw()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor reduction's value as a plain tensor (the same on every rank); else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
