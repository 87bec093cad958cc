"""The training loss a run reports: loss x samples and samples, summed over the epoch and over
the current log window, in float64.

The sums are exactly those that adding ``[loss * n, n]`` to a float64 tensor after every
micro-batch would give, bit for bit, but a micro-batch only appends its (device) loss to a
list. The additions happen in one go when the sums are read (a log row, a checkpoint, the end
of an epoch), in micro-batch order, so the loop launches no extra tensor operation per step
and never waits for the device in between. Those reads also note the first step whose loss
was not finite on this rank (:meth:`RunningLoss.first_nonfinite_step`), at no cost while the
sums stay finite.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class RunningLoss:
    """Running ``(loss x samples, samples)`` of the epoch and of the log window on one rank."""

    def __init__(self) -> None:
        self.epoch = [0.0, 0.0]     # loss x samples, samples
        self.window = [0.0, 0.0]
        self._losses: list[torch.Tensor] = []
        self._counts: list[int] = []
        self._steps: list[int] = []
        self._first_nonfinite: Optional[int] = None

    def add(self, loss: torch.Tensor, n: int, step: int = 0) -> None:
        """A micro-batch's mean loss (a detached scalar tensor) over its ``n`` samples, of optimizer
        step ``step`` (1-based; only to say where a loss first became non-finite)."""
        self._losses.append(loss)
        self._counts.append(n)
        self._steps.append(step)

    def _flush(self) -> None:
        if not self._losses:
            return
        losses, counts, steps = self._losses, self._counts, self._steps
        self._losses, self._counts, self._steps = [], [], []
        # loss.double() * n for each (a float64 product is exactly rounded wherever it is
        # computed), then sequential float64 additions: the same operations, in the same order,
        # as per-step in-place additions. On a device: one multiplication for all of them and
        # one copy to the host; on the CPU, reading each loss is cheaper than building tensors.
        products = (_products_on_host if losses[0].device.type == "cpu" else _products_on_device)(losses, counts)
        e, w = self.epoch, self.window
        for p, c in zip(products, counts):
            e[0] += p
            w[0] += p
            e[1] += c
            w[1] += c
        # A finite total means every product was finite: only a non-finite one is searched.
        if self._first_nonfinite is None and not math.isfinite(w[0]):
            self._first_nonfinite = next((s for p, s in zip(products, steps) if not math.isfinite(p)), None)

    def epoch_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's epoch sums as a float64 tensor (to reduce over ranks)."""
        self._flush()
        return torch.tensor(self.epoch, dtype=torch.float64, device=device)

    def window_values(self) -> list[float]:
        """This rank's log-window sums (loss x samples, samples) as float64 numbers (to reduce over ranks)."""
        self._flush()
        return [float(v) for v in self.window]

    def first_nonfinite_step(self) -> Optional[int]:
        """The first (global) step whose loss was inf or NaN on this rank, if any (reads the losses)."""
        self._flush()
        return self._first_nonfinite

    def new_epoch(self) -> None:
        self._flush()
        self.epoch = [0.0, 0.0]

    def new_window(self) -> None:
        self._flush()
        self.window = [0.0, 0.0]

    def state(self, device: torch.device) -> torch.Tensor:
        """Epoch and window sums as the 4-element float64 tensor a checkpoint saves."""
        self._flush()
        return torch.tensor(self.epoch + self.window, dtype=torch.float64, device=device)

    def load(self, sums: torch.Tensor) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        values = [float(v) for v in sums.detach().cpu().tolist()]
        self._losses, self._counts, self._steps = [], [], []
        self.epoch, self.window = values[0:2], values[2:4]


def _products_on_host(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    return [loss.item() * c for loss, c in zip(losses, counts)]


def _products_on_device(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    n = torch.tensor(counts, dtype=torch.float64, device=losses[0].device)
    return (torch.stack(losses).double() * n).tolist()
