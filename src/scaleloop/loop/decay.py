"""Which tensors ``--weight-decay`` applies to (``--decay-params``), as the optimizer's parameter groups.

Decaying a bias or a norm's scale pulls it towards zero for no gain (they do not grow with the
width, and a LayerNorm whose scale decays to zero silences its block), so nanoGPT, torchtitan
and Hugging Face's Trainer decay only the tensors of two or more dimensions: the matrices of
linear layers, convolution kernels and (except ``ndim2-no-embeddings``) embeddings.

The split is decided from each tensor's shape and the module that holds it, so it is the same
whatever the strategy made of the model (a DDP wrapper, FSDP2's sharded DTensors: ``ndim`` is
the whole tensor's).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Union

from torch import nn

ParamGroups = Union[list[nn.Parameter], list[dict[str, Any]]]
_OTHER = "other tensors of under 2 dimensions"
_REASONS = ("biases", "norms", "embeddings", _OTHER)   # in the order the summary names them


def _reason(module: nn.Module, name: str, param: nn.Parameter, rule: str) -> Optional[str]:
    """Why ``param`` (``module``'s own ``name``) is not decayed under ``rule``, or None if it is."""
    if rule == "all":
        return None
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and rule == "ndim2-no-embeddings":
        return "embeddings"
    if param.ndim >= 2:
        return None
    if name == "bias":
        return "biases"
    # Any norm (torch's, or a model's own RMSNorm class): its scale is 1-D.
    return "norms" if "norm" in type(module).__name__.lower() else _OTHER


def not_decayed(model: nn.Module, rule: str) -> dict[int, str]:
    """``id(parameter)`` -> why it is left out of weight decay, for the parameters ``rule`` leaves out.

    Read from ``model``'s modules as they are now: after a strategy placed the model, its
    modules hold the placed parameters (FSDP2 and tensor parallelism replace them in place)."""
    out: dict[int, str] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            reason = _reason(module, name, param, rule)
            if reason is not None:
                out.setdefault(id(param), reason)
    return out


def param_groups(params: Iterable[nn.Parameter], weight_decay: float, rule: str,
                 model: Optional[nn.Module]) -> ParamGroups:
    """``params`` as the optimizer takes them: a plain list when every one is decayed alike (no
    weight decay, ``rule`` all, nothing left out: the optimizer then is exactly the one a
    single-group run had), else the decayed group first and a group with no weight decay.

    ``model``: the module the parameters belong to, for the module-based rules (embeddings,
    norms); required unless ``rule`` is ``all`` or ``weight_decay`` is 0.
    """
    params = list(params)
    if not weight_decay or rule == "all":
        return params
    if model is None:
        raise ValueError(f"decay_params={rule!r} needs the model to tell embeddings and norms apart")
    left_out = not_decayed(model, rule)
    decayed = [p for p in params if id(p) not in left_out]
    rest = [p for p in params if id(p) in left_out]
    if not rest:
        return params
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    return groups + [{"params": rest, "weight_decay": 0.0}]


def describe_decay(model: nn.Module, weight_decay: float, rule: str) -> str:
    """One line for the run's header and summary, e.g. ``0.1 on 12 of 20 tensors (ndim2: 2 or more
    dimensions); not on 8: biases, norms``; "" without weight decay."""
    if not weight_decay:
        return ""
    total = len({id(p) for p in model.parameters()})
    if rule == "all":
        return f"{weight_decay:g} on all {total} tensors (--decay-params all)"
    left_out = not_decayed(model, rule)
    reasons = [r for r in _REASONS if r in left_out.values()]
    what = "2 or more dimensions" + (", not embeddings" if rule == "ndim2-no-embeddings" else "")
    text = f"{weight_decay:g} on {total - len(left_out)} of {total} tensors ({rule}: {what})"
    return text + (f"; not on {len(left_out)}: {', '.join(reasons)}" if left_out else "")
