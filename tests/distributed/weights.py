"""Final weights of a run and how far two runs' are apart: the comparison every equivalence test makes."""
from __future__ import annotations

from pathlib import Path

import torch


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """A run's final weights (``model.pt``), read weights-only."""
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference between ``a`` and ``b``, over the largest weight of ``a``, and where."""
    assert a.keys() == b.keys()
    scale = max(t.float().abs().max().item() for t in a.values())
    return max(((a[k].float() - b[k].float()).abs().max().item() / scale, k) for k in a)
