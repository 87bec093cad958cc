"""What goes into a checkpoint, and how it is turned into bytes and safely back.

Everything is stored as tensors and plain Python values (dicts, lists, tuples, numbers,
strings), so that it loads with ``torch.load(weights_only=True)``: a checkpoint is data, and
one that smuggles in pickled code is refused rather than executed.
"""
from __future__ import annotations

import io
import pickle
import random
from typing import Any, Mapping

import numpy as np
import torch

from scaleloop.checkpoint.store import CheckpointError


def to_bytes(state: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def from_bytes(data: bytes, source: str) -> dict[str, Any]:
    """Load checkpoint bytes with weights-only unpickling; CheckpointError naming ``source`` if refused."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message names the forbidden global on its first lines; keep it to one line.
        detail = " ".join(str(exc).split())
        what = detail.split("Unsupported global:", 1)[-1].split(".", 1)[0].strip() if "Unsupported global:" in detail else ""
        hint = f" ({what})" if what else ""
        raise CheckpointError(f"refusing to load {source}: it holds pickled Python objects{hint} that weights-only "
                              "loading does not allow; scaleloop checkpoints hold only tensors and plain values, "
                              "so this file was not written by scaleloop or was tampered with") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"{source} cannot be read as a checkpoint: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(state, dict) or ("model" not in state and "sharded" not in state):
        raise CheckpointError(f"{source} is not a scaleloop checkpoint (no 'model' entry)")
    return state


# --- random number generators ---------------------------------------------------------------
def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and CUDA on a CUDA device)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights-only loading refuses; store a tensor.
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device) -> None:
    """Put this process's RNGs back to ``state`` (from :func:`capture_rng`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device)


# --- model shape check ------------------------------------------------------------------------
def check_model_state(expected: Mapping[str, torch.Tensor], saved: Mapping[str, Any], source: str) -> None:
    """CheckpointError naming the keys that differ when ``saved`` does not fit the model."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if not (missing or unexpected or shapes):
        return

    def few(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    parts = []
    if shapes:
        parts.append(f"shape mismatch (checkpoint vs model): {few(shapes)}")
    if missing:
        parts.append(f"missing from the checkpoint: {few(missing)}")
    if unexpected:
        parts.append(f"not in the model: {few(unexpected)}")
    raise CheckpointError(f"{source} does not fit this model: {'; '.join(parts)} "
                          "(was it written for another --model or --hidden-dim?)")


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's part of the model's and optimizer's tensors that a checkpoint writes:
    a sharded tensor's local shard, and a tensor replicated over a mesh dimension only on that
    dimension's first rank (the one that writes it). Summed over ranks, the size of a sharded
    checkpoint's files, give or take their headers; a free-space check uses it before writing."""
    tensors = [*model.state_dict().values(),
               *(value for state in optimizer.state.values() for value in state.values())]
    return sum(_written_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _written_bytes(tensor: torch.Tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor.numel() * tensor.element_size()
    coordinate = tensor.device_mesh.get_coordinate() or []
    if any(p.is_replicate() and c != 0 for p, c in zip(tensor.placements, coordinate)):
        return 0
    local = to_local()
    return local.numel() * local.element_size()
