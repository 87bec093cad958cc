"""The one rule for batches: what in a sample is the model's input and what is the target, how
the model is called with it, and how a batch moves to a device (docs/models-and-data.md).

A sample from the dataset, or a batch the DataLoader collated, is cut into ``(inputs, target)``:

- a pair ``(x, y)``: ``model(x)``, target ``y``;
- a tuple or list of more than two, ``(x1, ..., xk, y)``: ``model(x1, ..., xk)``, target ``y``
  (a pair whose ``x`` is itself a tuple or list, ``((x1, x2), y)``, is called the same way);
- a mapping, e.g. ``{"input_ids", "attention_mask", "labels"}``: ``model(**inputs)``; the target
  is its ``labels`` entry (else the first of ``label``, ``target``, ``targets``, ``y``; with none,
  the model must return its own loss). That entry stays among the keyword arguments only when
  the model's ``forward`` takes it, as Hugging Face models take ``labels`` and then return their
  own loss; otherwise it is left out of the call.

A pair ``(x, y)`` whose model's ``forward`` names a target keyword (``targets``, ``labels``,
``y``, ...; nanoGPT's ``forward(idx, targets=None)``) is called with it as well,
``model(idx=x, targets=y)``: such a model computes its own loss from the target.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from scaleloop.errors import UsageError

#: Mapping entries that hold the target, in the order they are looked for.
TARGET_KEYS = ("labels", "label", "target", "targets", "y")

#: Keywords a ``forward`` may take the target by, for an ``(x, y)`` sample, in the order looked for.
TARGET_KEYWORDS = ("targets", "labels", "target", "label", "y")

#: How a sample's target reaches the model: False (it does not), True (a mapping sample's target
#: entry stays among the keyword arguments), or ``(input name, target keyword)``: an ``(x, y)``
#: sample becomes ``{input name: x, target keyword: y}``, the call ``model(**that)``.
TargetRoute = Union[bool, tuple[str, str]]

#: In-memory columns: the tensors of a ``TensorDataset`` or a ``DictTensorDataset``.
Columns = Union[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]


class DictTensorDataset(Dataset):
    """In-memory samples as named tensors: sample ``i`` is ``{name: tensor[i]}``.

    Like ``TensorDataset`` for mappings: batches are gathered with one ``index_select`` per
    tensor (scaleloop's fast path), and each batch is a mapping of the same names.
    """

    def __init__(self, tensors: Optional[Mapping[str, torch.Tensor]] = None, **named: torch.Tensor) -> None:
        self.tensors: dict[str, torch.Tensor] = {**(tensors or {}), **named}
        sizes = {name: t.shape[0] if t.dim() else None for name, t in self.tensors.items()}
        if not self.tensors or len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(f"DictTensorDataset needs tensors with the same first dimension, got {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[i] for name, t in self.tensors.items()}


def tensors_of(dataset: Dataset) -> Optional[Columns]:
    """The dataset's tensors when it holds them in memory and indexes them plainly (a
    ``TensorDataset`` of two or more tensors, or a ``DictTensorDataset``), else None."""
    # A subclass that overrides __getitem__ (augmentation, transforms) must be read through
    # it, so only datasets that index their tensors exactly as the base class does qualify.
    getitem = getattr(type(dataset), "__getitem__", None)
    tensors = getattr(dataset, "tensors", None)
    if getitem is TensorDataset.__getitem__:
        if isinstance(tensors, (tuple, list)) and len(tensors) >= 2 and all(
                isinstance(t, torch.Tensor) for t in tensors):
            return tuple(tensors)
    elif getitem is DictTensorDataset.__getitem__ and isinstance(tensors, dict):
        return tensors
    return None


def take(columns: Columns, index: torch.Tensor) -> Any:
    """The samples at ``index`` of every column, as the dataset's collated batch would hold them."""
    if isinstance(columns, dict):
        return {name: t.index_select(0, index) for name, t in columns.items()}
    return tuple(t.index_select(0, index) for t in columns)


def target_key(sample: Mapping[str, Any]) -> Optional[str]:
    """The entry of a mapping sample that holds the target (None: it has none)."""
    for key in TARGET_KEYS:
        if key in sample:
            return key
    return None


def split(sample: Any, keep_target: TargetRoute = False) -> tuple[Any, Any]:
    """``(inputs, target)`` of a sample or collated batch, by the rule in this module's docstring.

    ``keep_target``: how the target also reaches the model (:data:`TargetRoute`, from
    :func:`keeps_target`); the target is returned either way.
    """
    if isinstance(sample, Mapping):
        key = target_key(sample)
        if key is None:
            return dict(sample), None
        inputs = dict(sample) if keep_target else {k: v for k, v in sample.items() if k != key}
        return inputs, sample[key]
    if isinstance(sample, (tuple, list)):
        if len(sample) == 2:
            if isinstance(keep_target, tuple):
                name, keyword = keep_target
                return {name: sample[0], keyword: sample[1]}, sample[1]
            return sample[0], sample[1]
        if len(sample) > 2:
            return tuple(sample[:-1]), sample[-1]
    raise UsageError(f"a sample must be (x, y), (x1, ..., xk, y) or a mapping with a 'labels' entry; "
                     f"got {describe(sample)}")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """The model's output for ``inputs``: ``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        try:
            return model(**inputs)
        except TypeError as exc:
            if _not_taken(model, exc):
                raise UsageError(f"the batch's entries {', '.join(sorted(map(str, inputs)))} are the model's keyword "
                                 f"arguments, and {exc}: give forward that parameter, or leave the entry out of "
                                 "the samples") from None
            raise
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _not_taken(model: nn.Module, exc: TypeError) -> bool:
    """Whether ``exc`` is Python refusing the call's keywords (raised before ``forward``'s body
    ran), not a TypeError from inside the model."""
    if "unexpected keyword argument" not in str(exc):
        return False
    # forward's own frame never started when Python refused its keywords; a call inside it that
    # was refused (a submodule given a keyword it lacks) passes through that frame.
    forward = getattr(getattr(model, "forward", None), "__code__", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is forward:
            return False
        tb = tb.tb_next
    return True


def takes_keyword(model: nn.Module, name: str) -> bool:
    """True when ``model.forward`` accepts the keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or p.kind is p.VAR_KEYWORD for p in params)


def keeps_target(model: nn.Module, dataset: Dataset, task: Optional[str] = None) -> TargetRoute:
    """How the target of ``dataset``'s samples reaches ``model`` (:data:`TargetRoute`): a mapping's
    target entry when the forward takes it; an ``(x, y)`` pair's ``y`` when the forward names a
    target keyword (:data:`TARGET_KEYWORDS`); else not at all.

    ``task`` "lm": a pair's ``y`` is the next tokens already, which a ``labels`` keyword does not
    take (Hugging Face causal LMs shift their ``labels`` themselves: the run would learn the token
    after next); only ``targets``, ``target`` or ``y`` (nanoGPT's convention) get it.
    """
    if not any(takes_keyword(model, key) for key in TARGET_KEYS):
        return False  # decided without reading a sample (a dataset's reads may cost, or be counted)
    try:
        sample = first_sample(dataset)
    except Exception:  # an empty or odd dataset: decided per batch by the default (left out)
        return False
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and not isinstance(sample[0], (tuple, list)):
        return _pair_route(model, tuple(k for k in TARGET_KEYWORDS if not k.startswith("label"))
                           if task == "lm" else TARGET_KEYWORDS)
    if not isinstance(sample, Mapping):
        return False
    key = target_key(sample)
    return key is not None and takes_keyword(model, key)


def _pair_route(model: nn.Module, keywords: tuple[str, ...]) -> TargetRoute:
    """``(input name, target keyword)`` when ``model.forward(first, ..., <keyword>=None)`` names both
    (by name: a ``**kwargs`` forward is not guessed at), else False."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not named or named[0].kind is not named[0].POSITIONAL_OR_KEYWORD:
        return False
    others = {p.name for p in named[1:]}
    keyword = next((k for k in keywords if k in others), None)
    return (named[0].name, keyword) if keyword is not None else False


def first_sample(dataset: Dataset) -> Any:
    """``dataset[0]``, or the first sample a stream (an ``IterableDataset``) yields; IndexError when empty."""
    if isinstance(dataset, IterableDataset):
        for sample in dataset:
            return sample
        raise IndexError("the stream yielded no sample")
    return dataset[0]


def move(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor in it (nested in tuples, lists and mappings) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(o, device, non_blocking) for o in obj)
    if isinstance(obj, Mapping):
        return {k: move(v, device, non_blocking) for k, v in obj.items()}
    return obj


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``obj`` (itself, or nested in tuples, lists and mappings); a numpy
    array counts, as a tensor (the DataLoader's collation turns it into one too)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if _is_numpy_array(obj):
        return torch.as_tensor(obj)
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def _is_numpy_array(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "shape") and hasattr(obj, "__array__")


def describe(obj: Any) -> str:
    """A short description of a sample or an output for an error message: type and structure."""
    if isinstance(obj, torch.Tensor):
        return f"a tensor {list(obj.shape)} {str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, Mapping):
        return f"a {type(obj).__name__} with keys {list(obj)[:8]}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    kind = type(obj)
    return f"a {kind.__qualname__ if kind.__module__ == 'builtins' else kind.__module__ + '.' + kind.__qualname__}"
