"""A model's weights as files other tools read, and weights read back from such files.

Out: ``model.safetensors``, the final weights in the safetensors format (plain tensors and a
JSON header: nothing in it can run), written next to ``model.pt`` when the ``safetensors``
package is importable (transformers installs it; scaleloop itself does not require it).

In (``--init-from``, ``scaleloop sample``): a safetensors file, a transformers directory
(``config.json`` with ``model.safetensors`` or its sharded index), a run directory (its
``model.safetensors``, else ``model.pt``) or a ``.pt`` file of tensors. A ``.pt`` file is read
with ``torch.load(weights_only=True)``: a file a user hands over is data, and one that holds
pickled code is refused in one line, never run.
"""
from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from scaleloop.checkpoint.state import check_model_state
from scaleloop.errors import UsageError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"   # a transformers model saved in shards
TORCH_FILE = "model.pt"


def safetensors_available() -> bool:
    """Whether the optional ``safetensors`` package imports here."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def safetensors_bytes(state: Mapping[str, Any]) -> bytes:
    """``state``'s tensors as the bytes of a safetensors file (the caller checks it is importable).

    safetensors refuses two names for one storage (TinyGPT's head is its token embedding; a
    view into a fused tensor is another case): the second name gets a copy, so that the file
    holds every key of the ``state_dict`` and loads back with ``load_state_dict`` alone.
    Entries that are not tensors (a module's ``_extra_state``) have no place in the format."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        tensors[name] = tensor.contiguous()
    # "format": "pt" is what transformers' loader looks for in a file it did not write.
    return save(tensors, metadata={"format": "pt"})


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; UsageError (one line) when it is not one."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UsageError(f"reading {str(path)!r} needs the safetensors package (pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:   # safetensors' own error type, a truncated header, an unreadable file
        raise UsageError(f"{str(path)!r} cannot be read as a safetensors file: {_first_line(exc)}") from None


def read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pt`` file of tensors by name, read weights-only; UsageError (one line) for anything else."""
    try:
        with warnings.catch_warnings():
            # A pickle torch.save did not write warns of its protocol before it is refused (or
            # read): the one line below says what matters.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = " ".join(str(exc).split())
        named = detail.split("Unsupported global:", 1)[-1].split(".", 1)[0].strip() if "Unsupported global:" in detail \
            else ""
        raise UsageError(f"refusing to load {str(path)!r}: it holds pickled Python objects"
                         f"{f' ({named})' if named else ''} that weights-only loading does not allow; weights "
                         "are tensors by name, so this file was not written as weights or was tampered with "
                         "(nothing in it was run)") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise UsageError(f"{str(path)!r} cannot be read as weights: {_first_line(exc)}") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]   # a scaleloop checkpoint's model.pt: the weights are under "model"
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"{str(path)!r} does not hold weights (a dict of tensors by name)")
    return state


def _read_sharded(directory: Path) -> dict[str, torch.Tensor]:
    """A transformers directory saved in shards: every file its index names, in this directory."""
    index = directory / SAFETENSORS_INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{str(index)!r} is not a safetensors index: {_first_line(exc)}") from None
    state: dict[str, torch.Tensor] = {}
    for name in files:
        # Only files beside the index: a hostile index must not point anywhere else.
        if not isinstance(name, str) or Path(name).name != name:
            raise UsageError(f"{str(index)!r} names {name!r}, not a file in its own directory")
        state.update(read_safetensors(directory / name))
    return state


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights at ``path``: a safetensors file, a ``.pt`` file, a transformers directory or a
    run directory (safetensors first: reading it runs nothing and needs no unpickler).
    UsageError (one line) when there are none."""
    if path.is_file():
        return read_safetensors(path) if path.suffix == ".safetensors" else read_torch_file(path)
    if not path.is_dir():
        raise UsageError(f"{str(path)!r} does not exist: give a .safetensors file, a transformers directory "
                         "or a run directory")
    if (path / SAFETENSORS_FILE).is_file():
        return read_safetensors(path / SAFETENSORS_FILE)
    if (path / SAFETENSORS_INDEX).is_file():
        return _read_sharded(path)
    if (path / TORCH_FILE).is_file():
        return read_torch_file(path / TORCH_FILE)
    raise UsageError(f"{str(path)!r} holds no weights: expected {SAFETENSORS_FILE} (a run or a transformers "
                     f"directory), {SAFETENSORS_INDEX} or {TORCH_FILE}")


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Each ``state_dict`` key whose tensor is an earlier key's tensor (a tied weight) -> that key."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model`` (the user's own module, before any strategy wraps it).

    A tied weight may be saved once (transformers' ``save_pretrained`` leaves out the output
    layer that is the embedding): its other name is filled from the one present. Then the keys
    and shapes must match the model's exactly; UsageError (one line) naming those that do not."""
    state, expected = dict(state), model.state_dict()
    for name, twin in _tied_names(model).items():
        # Filled only where it fits: a misfit is reported under the name the file holds.
        for missing, present in ((name, twin), (twin, name)):
            if missing not in state and present in state and state[present].shape == expected[missing].shape:
                state[missing] = state[present]
    check_model_state(expected, state, source)
    model.load_state_dict(state)


def init_weights(model: nn.Module, init_from: Optional[str]) -> list[str]:
    """``--init-from PATH``: the model starts from the weights at PATH (every rank reads them).
    Returns the note line that says so (none without ``--init-from``)."""
    if init_from is None:
        return []
    state = read_weights(Path(init_from))
    load_weights(model, state, f"--init-from {init_from}")
    return [f"note: the model starts from the weights in {init_from} ({len(state):,} tensors), not random ones"]
