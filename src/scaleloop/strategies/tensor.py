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

A Hugging Face ``transformers`` model needs no method: its own plan (``model.tp_plan``, which
transformers builds from the config's ``base_model_tp_plan`` and the class's ``_tp_plan``, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", ...}``) is used where torch's styles express it
(:data:`TRANSFORMERS_STYLES`), its ``*`` standing for any one part of a name (the layer index).
Anything else (a style such as ``sequence_parallel``, a layer that is not a ``Linear``, no plan
at all, as for GPT-2 with its ``Conv1D`` layers) is refused in one line: a model is never left
whole on every rank when ``tp`` was asked for. The attention of a split model runs on its
``heads / tp`` local heads (transformers reshapes q, k and v by ``head_dim``), so the heads and
key/value heads must divide by ``tp``.

A colwise layer followed by a rowwise one (Megatron's MLP and attention split) needs one
all-reduce in the forward and one in the backward. Everything not in the plan stays whole on
every ``tp`` rank, and so does the model's output: the loss is computed as on one process. The
method raises ``ValueError`` when the model cannot be split ``tp`` ways (heads not divisible).
A weight tied to another (an embedding and its output layer) is never split: split under two
names, it would become two weights that train apart.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
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
    """The model's plan as ``{submodule name: ParallelStyle}``: its ``tp_plan(tp)`` method, else a
    transformers model's own plan (:func:`transformers_styles`). UsageError (one line) for a model
    without either, a plan that names no submodule or a style that cannot be expressed, a model that
    cannot split ``tp`` ways, or a tied weight in a split layer."""
    method = getattr(model, "tp_plan", None)
    name = type(model).__name__
    if not callable(method):
        if _is_transformers(model):
            styles = transformers_styles(model, tp)
            _check_untied(model, styles, tp)
            return styles
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
    _check_untied(model, styles, tp)
    return styles


#: transformers' plan styles that scaleloop splits, with the layer class each applies to, and how
#: (transformers' own definitions, in ``transformers/distributed/tensor_parallel.py``, are the
#: same layouts written for its loader): ``colwise`` and ``rowwise`` are Megatron's pair;
#: ``colwise_gather_output`` (``colwise_rep``) gathers the split outputs, so the output layer's
#: logits are whole on every rank; ``embedding_rowwise`` splits the vocabulary, each rank looking up
#: the tokens it holds and the ranks' lookups summed; ``replicate`` leaves the layer whole.
TRANSFORMERS_STYLES: dict[str, str] = {
    "colwise": "Linear", "rowwise": "Linear", "colwise_gather_output": "Linear", "colwise_rep": "Linear",
    "embedding_rowwise": "Embedding", "replicate": "",
}


def _is_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (a class of its package in its bases), read
    without importing transformers."""
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


def _transformers_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's plan, names from the root: the ``tp_plan`` property (transformers 5),
    else the ``_tp_plan`` that older releases fill the same way; {} when it has none."""
    for attribute in ("tp_plan", "_tp_plan"):
        plan = getattr(model, attribute, None)
        if isinstance(plan, dict) and plan:
            return dict(plan)
    return {}


def _matching(model: nn.Module, pattern: str) -> list[str]:
    """The submodule names that ``pattern`` names, part by part (``*`` is any one part, as in
    transformers' plans: ``model.layers.*.mlp.up_proj`` is each layer's ``up_proj``)."""
    parts = pattern.split(".")
    return [name for name, _ in model.named_modules()
            if name and len(name.split(".")) == len(parts)
            and all(fnmatchcase(have, want) for have, want in zip(name.split("."), parts))]


def transformers_styles(model: nn.Module, tp: int) -> dict[str, Any]:
    """A transformers model's own plan as ``{submodule name: torch ParallelStyle}``, one entry per
    layer its patterns name (an entry naming no layer of this model, e.g. a mixture-of-experts
    variant's, is passed over). UsageError (one line) naming what scaleloop cannot split."""
    name = type(model).__name__
    plan = _transformers_plan(model)
    if not plan:
        conv = any(type(m).__name__ == "Conv1D" for m in model.modules())
        why = (": its layers are Conv1D, not the nn.Linear that torch's ColwiseParallel and RowwiseParallel "
               "split" if conv else "")
        raise UsageError(f"tensor parallelism (--mesh tp={tp}) needs the model's plan: {name} has none (no tp_plan() "
                         f"method, and transformers gives it no tensor-parallel plan{why}); drop tp from --mesh, or "
                         "give the model a tp_plan(tp) method (docs/strategies.md, 'Tensor parallelism')")
    _check_heads(model, tp)
    colwise, rowwise, _ = _styles()
    from torch.distributed.tensor import Replicate

    styles: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for pattern, kind in plan.items():
        for where in _matching(model, pattern):
            if kinds.get(where, kind) != kind:
                raise UsageError(f"{name}'s tensor-parallel plan (transformers) names {where!r} twice, as "
                                 f"{kinds[where]!r} and {kind!r}; give the model a tp_plan(tp) method")
            kinds[where] = kind
            layer = model.get_submodule(where)
            wanted = TRANSFORMERS_STYLES.get(kind) if isinstance(kind, str) else None
            if wanted is None:
                raise UsageError(f"--mesh tp={tp}: {name}'s tensor-parallel plan (transformers) splits {where!r} "
                                 f"as {kind!r}, which scaleloop cannot express (it splits "
                                 f"{', '.join(repr(k) for k in TRANSFORMERS_STYLES)}); drop tp from --mesh, or give "
                                 "the model a tp_plan(tp) method (docs/strategies.md, 'Tensor parallelism')")
            if not wanted:
                continue   # "replicate": whole on every rank, as everything outside the plan
            if not isinstance(layer, getattr(nn, wanted)):
                raise UsageError(f"--mesh tp={tp}: in {name}'s tensor-parallel plan (transformers), {where!r} is a "
                                 f"{type(layer).__name__}: {kind!r} splits an nn.{wanted}; drop tp from --mesh, or "
                                 "give the model a tp_plan(tp) method")
            size, what = _split_size(layer, kind)
            if size % tp:
                raise UsageError(f"--mesh tp={tp}: {name} cannot be split {tp} ways: {where!r} has {size} {what}, "
                                 f"which do not divide by tp={tp}")
            if kind == "colwise":
                styles[where] = colwise()
            elif kind == "rowwise":
                styles[where] = rowwise()
            elif kind in ("colwise_gather_output", "colwise_rep"):
                styles[where] = colwise(output_layouts=Replicate())
            else:   # embedding_rowwise: the token ids are whole on every rank
                styles[where] = rowwise(input_layouts=Replicate())
    if not styles:
        raise UsageError(f"tensor parallelism (--mesh tp={tp}): {name}'s tensor-parallel plan (transformers) names "
                         "no layer of the model; drop tp from --mesh, or give the model a tp_plan(tp) method")
    return styles


def _split_size(layer: nn.Module, kind: str) -> tuple[int, str]:
    """The size the style cuts ``tp`` ways, and what it counts, for the line that refuses it."""
    if isinstance(layer, nn.Embedding):
        return layer.num_embeddings, "embeddings"
    if kind == "rowwise":
        return layer.in_features, "input features"
    return layer.out_features, "output features"


def _check_heads(model: nn.Module, tp: int) -> None:
    """The attention of a split layer runs ``heads / tp`` heads on each rank, and as many
    key/value heads (grouped-query attention keeps their ratio): both must divide by ``tp``."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
        if isinstance(count, int) and count % tp:
            raise UsageError(f"--mesh tp={tp}: {type(model).__name__} cannot be split {tp} ways: its {count} {what} "
                             f"do not divide by tp={tp}; use a tp that divides {count}")


def _check_untied(model: nn.Module, styles: dict[str, Any], tp: int) -> None:
    """Refuse a split layer whose weight is tied to another name (an output layer sharing the
    input embedding's weight): ``parallelize_module`` would replace it by a split copy under one
    name only, and the two would train apart, a model other than the one asked for."""
    names: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(pname)
    for where in styles:
        for pname, param in model.get_submodule(where).named_parameters(prefix=where):
            others = [n for n in names.get(id(param), []) if n != pname]
            if others:
                raise UsageError(f"--mesh tp={tp}: {pname!r} is tied to {others[0]!r} (one weight under two names), "
                                 "and tensor parallelism would split it into two that train apart; untie them "
                                 "(transformers: tie_word_embeddings=False) or drop tp from --mesh")


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
