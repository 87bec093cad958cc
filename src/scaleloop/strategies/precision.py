"""Numeric precision as one object: autocast for the forward pass, a GradScaler for fp16."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from scaleloop.errors import UsageError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NOTHING = contextlib.nullcontext()   # reusable: it holds no state


class Precision:
    """``fp32`` (nothing), ``bf16`` (autocast), or ``fp16`` (autocast + loss scaling).

    fp16 has too few exponent bits for small gradients, so its loss is multiplied by a
    scale before backward and the gradients divided again before the optimizer sees them;
    bf16 has fp32's exponent range and needs no scaler.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in ("fp32", "bf16", "fp16"):
            raise UsageError(f"--precision {name!r} is not one of: fp32, bf16, fp16")
        if name == "fp16" and device.type == "mps":
            raise UsageError("--precision fp16 with a GradScaler is not supported on MPS; use bf16 or fp32")
        self.name = name
        self.device = device
        self.dtype = _DTYPES.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Run the forward pass (and loss) in reduced precision where it is safe."""
        if self.dtype is None:
            return _NOTHING  # fp32: nothing to do (and nothing to pay per step)
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size (before clipping or inspecting them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; with fp16, skip the step if gradients overflowed. True if stepped."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it skipped the step for inf/NaN gradients.
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
