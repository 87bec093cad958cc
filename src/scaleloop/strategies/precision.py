"""Numeric precision as one object: autocast for the forward pass, a GradScaler for fp16."""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

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
        #: Steps the scaler skipped (inf/NaN gradients), counted on the device: None until the first fp16 step.
        self.skipped: Optional[torch.Tensor] = None

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

    def step(self, optimizer: torch.optim.Optimizer) -> Union[bool, torch.Tensor]:
        """Step the optimizer; with fp16, skip the step if gradients overflowed.

        Returns True without a scaler; with fp16 a 0-dim bool tensor on the device, True if it
        stepped (``bool()`` of it waits for the device, so the training loop never reads it:
        it reads :attr:`skipped` at its log rows instead).
        """
        if self.scaler is None:
            optimizer.step()
            return True
        scale = getattr(self.scaler, "_scale", None)   # the scale as a device tensor, if this torch has it
        if scale is None:  # no device tensor to compare: fall back to the scale as numbers (a sync)
            before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            stepped = torch.tensor(self.scaler.get_scale() >= before, device=self.device)
        else:
            before = scale.clone()
            self.scaler.step(optimizer)
            self.scaler.update()
            # The scaler lowers its scale exactly when it skipped the step for inf/NaN gradients;
            # compared on the device, so that nothing waits for it here.
            stepped = self.scaler._scale >= before
        if self.skipped is None:
            self.skipped = torch.zeros((), dtype=torch.int64, device=stepped.device)
        self.skipped += ~stepped
        return stepped

    def skipped_steps(self) -> int:
        """How many optimizer steps the fp16 scaler has skipped in this process (reads the device)."""
        return int(self.skipped) if self.skipped is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
