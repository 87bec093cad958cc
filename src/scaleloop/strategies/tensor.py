"""Tensor parallelism: the layers a model names are split over the ``tp`` ranks of the mesh.

A model says how with a method (docs/strategies.md, "Tensor parallelism"):

    def tp_plan(self, tp: int) -> dict[str, str | ParallelStyle]

which maps submodule names (``model.get_submodule`` paths) to how each is split:

- ``"colwise"``: a ``Linear``'s output features are split (``ColwiseParallel``): each rank
  computes its slice of the outputs from the whole input;
- ``"colwise:N"``: the same for a Linear whose output is N equal parts side by side (a fused
  query/key/value projection, N=3): each part is split, so rank r gets slice r of every part
  (``_StridedShard``), and the parts stay whole heads;
- ``"rowwise"``: a ``Linear``'s input features are split (``RowwiseParallel``): each rank
  multiplies its slice, and the partial results are summed over the ``tp`` ranks (all-reduce),
  so the output is whole and the same on every ``tp`` rank;
- or any ``torch.distributed.tensor.parallel`` ``ParallelStyle`` object.

A colwise layer followed by a rowwise one (Megatron's MLP and attention split) needs one
all-reduce in the forward and one in the backward. Everything not in the plan stays whole on
every ``tp`` rank, and so does the model's output: the loss is computed as on one process. The
method raises ``ValueError`` when the model cannot be split ``tp`` ways (heads not divisible).
"""
from __future__ import annotations

from typing import Any, Union

from torch import nn

from scaleloop.errors import UsageError


def _styles() -> tuple[type, type, type]:
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    return ColwiseParallel, RowwiseParallel, ParallelStyle


def fused_colwise(parts: int) -> Any:
    """A ``ColwiseParallel`` for a Linear whose output is ``parts`` equal blocks side by side
    (q, k, v): each block is split over the ``tp`` ranks, so that rank r holds slice r of every
    block, and its local output is ``[q_r | k_r | v_r]``."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    colwise = _styles()[0]

    class FusedColwiseParallel(colwise):  # type: ignore[misc, valid-type]
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            # _StridedShard(0, split_factor=parts): rows cut into `parts` blocks first, then each
            # block cut over the mesh; full_tensor() (checkpoints, verify) gives back the original.
            # The bias stays whole (Replicate; each rank adds its slice of it): a split 1-D bias
            # could not be sharded again by FSDP on its only dimension in a layout that DTensor
            # (checkpoints, verify) can describe. The weight is sharded by FSDP on dim 1.
            for pname, param in module.named_parameters():
                placement = _StridedShard(0, split_factor=parts) if param.dim() > 1 else Replicate()
                placed = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
                module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            # The strided output is what the attention needs locally (whole heads); a
            # redistribution to ColwiseParallel's Shard(-1) would mix q, k and v.
            return outputs.to_local() if use_local_output else outputs

    return FusedColwiseParallel()


def _style(spec: Union[str, Any], where: str) -> Any:
    colwise, rowwise, parallel_style = _styles()
    if isinstance(spec, parallel_style):
        return spec
    if spec == "colwise":
        return colwise()
    if spec == "rowwise":
        return rowwise()
    if isinstance(spec, str) and spec.startswith("colwise:") and spec[8:].isdigit() and int(spec[8:]) >= 1:
        if not strided_tp_supported():
            import torch

            raise UsageError(f"tp_plan(): {where!r} -> {spec!r} (a fused layer split in whole parts) needs torch "
                             f"2.13 or newer, whose DTensor runs a Linear with a strided-sharded weight; this is "
                             f"torch {torch.__version__}: upgrade torch, or drop tp from --mesh")
        return fused_colwise(int(spec[8:]))
    raise UsageError(f"tp_plan(): {where!r} -> {spec!r} is not a way to split a layer; use 'colwise', "
                     "'colwise:N', 'rowwise' or a torch ParallelStyle")


def strided_tp_supported() -> bool:
    """Whether this torch runs ``colwise:N`` layers: torch 2.11's DTensor cannot redistribute a
    Linear's input against a ``_StridedShard`` weight (tested: 2.11 fails, 2.13 and 2.15 work)."""
    import torch
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__.split("+")[0]) >= "2.13"


def tp_plan_of(model: nn.Module, tp: int) -> dict[str, Any]:
    """The model's ``tp_plan(tp)`` as ``{submodule name: ParallelStyle}``; UsageError (one line)
    for a model without one, a plan that names no submodule, or a model that cannot split ``tp`` ways."""
    method = getattr(model, "tp_plan", None)
    name = type(model).__name__
    if not callable(method):
        raise UsageError(f"tensor parallelism (--mesh tp={tp}) needs the model's plan: {name} has no tp_plan() "
                         "method (docs/strategies.md, 'Tensor parallelism'); drop tp from --mesh")
    try:
        plan = method(tp)
    except ValueError as exc:
        raise UsageError(f"--mesh tp={tp}: {name} cannot be split {tp} ways: {exc}") from None
    if not isinstance(plan, dict) or not plan:
        raise UsageError(f"{name}.tp_plan({tp}) must return a non-empty dict of submodule name -> style")
    styles = {}
    for where, spec in plan.items():
        try:
            model.get_submodule(where)
        except AttributeError:
            raise UsageError(f"{name}.tp_plan(): {where!r} is not a submodule of the model") from None
        styles[where] = _style(spec, where)
    return styles


def fsdp_placement(param: Any) -> Any:
    """FSDP2's ``shard_placement_fn``: a weight split by ``colwise:N`` (strided over ``tp`` on
    dim 0) is sharded over the data ranks on dim 1, so the two cuts stay independent and the
    whole tensor can be put back together; every other parameter on dim 0 (FSDP's default)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    strided = any(isinstance(p, _StridedShard) for p in getattr(param, "placements", ()))
    return Shard(1) if strided and param.dim() > 1 else None


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> int:
    """Split the layers of the model's plan over ``tp_mesh`` (a 1-D ``DeviceMesh``), in place;
    returns how many layers were split. With one ``tp`` rank nothing changes."""
    tp = tp_mesh.size()
    if tp == 1:
        return 0
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan_of(model, tp)
    parallelize_module(model, tp_mesh, plan)
    return len(plan)
