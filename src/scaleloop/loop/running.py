"""The training loss a run reports: loss x samples and samples, summed over the epoch and over
the current log window, in float64.

The sums are exactly those that adding ``[loss * n, n]`` to a float64 tensor after every
micro-batch would give, bit for bit, but a micro-batch only appends its (device) loss to a
list. The additions happen in one go when the sums are read (a log row, a checkpoint, the end
of an epoch), in micro-batch order, so the loop launches no extra tensor operation per step
and never waits for the device in between.
"""
from __future__ import annotations

import torch


class RunningLoss:
    """Running ``(loss x samples, samples)`` of the epoch and of the log window on one rank."""

    def __init__(self) -> None:
        self.epoch = [0.0, 0.0]     # loss x samples, samples
        self.window = [0.0, 0.0]
        self._losses: list[torch.Tensor] = []
        self._counts: list[int] = []

    def add(self, loss: torch.Tensor, n: int) -> None:
        """A micro-batch's mean loss (a detached scalar tensor) over its ``n`` samples."""
        self._losses.append(loss)
        self._counts.append(n)

    def _flush(self) -> None:
        if not self._losses:
            return
        losses, counts = self._losses, self._counts
        self._losses, self._counts = [], []
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

    def epoch_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's epoch sums as a float64 tensor (to reduce over ranks)."""
        self._flush()
        return torch.tensor(self.epoch, dtype=torch.float64, device=device)

    def window_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's log-window sums as a float64 tensor (to reduce over ranks)."""
        self._flush()
        return torch.tensor(self.window, dtype=torch.float64, device=device)

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
        self._losses, self._counts = [], []
        self.epoch, self.window = values[0:2], values[2:4]


def _products_on_host(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    return [loss.item() * c for loss, c in zip(losses, counts)]


def _products_on_device(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    n = torch.tensor(counts, dtype=torch.float64, device=losses[0].device)
    return (torch.stack(losses).double() * n).tolist()
