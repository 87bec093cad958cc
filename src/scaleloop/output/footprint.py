"""What the model takes in memory on each rank: parameters, gradients, optimizer state.

With a replicated strategy (single, ddp, allreduce) every rank holds all of it; with fsdp each
rank holds its shards, about 1/N. The numbers are the sizes of the tensors themselves (a
DTensor's local shard via ``to_local()``), not what the allocator reserved; communication
buffers (DDP's gradient buckets, FSDP's all-gathered parameters during a unit's forward and
backward) are not in them, but they are in the peak CUDA memory reported on a GPU.

``train`` measures gradients once, between the first backward and its optimizer step (they are
freed right after), gathers every rank's numbers to rank 0 at the end of the run, prints them
in the summary and writes ``memory.json`` to the run directory.
"""
from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory, in bytes."""

    rank: int
    parameters: int                  # this rank's parameter tensors (its shards under fsdp)
    gradients: Optional[int]         # its gradients before an optimizer step (None: no step was taken)
    optimizer: int                   # its optimizer state tensors (Adam moments, momentum, steps)
    model_parameters: int            # all parameters of the model, unsharded (the same on every rank)
    peak_cuda: Optional[int] = None  # torch.cuda.max_memory_allocated on its GPU
    peak_rss: Optional[int] = None   # the process's peak resident memory (all of it: torch, data, ...)

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.parameters + (self.gradients or 0) + self.optimizer

    @property
    def parameter_share(self) -> float:
        """This rank's parameters as a fraction of the whole model's."""
        return self.parameters / self.model_parameters if self.model_parameters else float("nan")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the (local parts of the) tensors among ``tensors``, each tensor counted once."""
    seen: set[int] = set()
    total = 0
    with torch.no_grad():
        for t in tensors:
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))  # ``t`` stays alive (the model or optimizer holds it), so ids are unique
            local = _local(t)
            total += local.numel() * local.element_size()
    return total


def _state_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _state_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _state_tensors(value)


def gradient_bytes(model: nn.Module) -> Optional[int]:
    """Bytes of the gradients the parameters hold now (None if none has one)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return tensor_bytes(grads) if grads else None


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of all of the model's parameters, unsharded (tied parameters counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def reset_peak(device: torch.device) -> None:
    """Start ``device``'s peak-memory count afresh (CUDA; nothing to do elsewhere).

    ``torch.cuda.max_memory_allocated`` counts from the process's start or the last reset, so
    a second run in one process (verify, bench, a notebook) would report the first one's peak.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, device: torch.device,
            gradients: Optional[int], model_bytes: Optional[int] = None) -> RankMemory:
    """This rank's numbers (no collective). ``model_bytes``: the whole model's parameter bytes,
    when this rank holds only part of the model (a pipeline stage); default: ``model``'s."""
    params = list(model.parameters())
    peak_cuda = None
    if device.type == "cuda" and torch.cuda.is_available():
        peak_cuda = int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak_rss = int(rss if sys.platform == "darwin" else rss * 1024)
    return RankMemory(rank=rank, parameters=tensor_bytes(params), gradients=gradients,
                      optimizer=tensor_bytes(_state_tensors(list(optimizer.state.values()))),
                      model_parameters=model_bytes if model_bytes is not None else parameter_bytes(model),
                      peak_cuda=peak_cuda, peak_rss=peak_rss)


def format_bytes(n: Optional[float]) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def summary_line(ranks: Sequence[RankMemory]) -> str:
    """The summary's one line: the largest rank's parameters + gradients + optimizer state."""
    top = max(ranks, key=lambda r: r.total)
    where = f" on the largest of {len(ranks)} ranks" if len(ranks) > 1 else ""
    text = (f"{format_bytes(top.total)}{where}: parameters {format_bytes(top.parameters)} "
            f"({top.parameter_share:.0%} of the model), gradients {format_bytes(top.gradients)}, "
            f"optimizer state {format_bytes(top.optimizer)}")
    peaks = [r.peak_cuda for r in ranks if r.peak_cuda is not None]
    if peaks:
        text += f"; peak CUDA {format_bytes(max(peaks))}"
    return text


def format_table(ranks: Sequence[RankMemory]) -> str:
    """One row per rank (the summary prints it when there are several)."""
    cuda = any(r.peak_cuda is not None for r in ranks)
    header = ["rank", "parameters", "gradients", "optimizer", "total", "of the model"] + (["peak CUDA"] if cuda else [])
    rows = [[str(r.rank), format_bytes(r.parameters), format_bytes(r.gradients), format_bytes(r.optimizer),
             format_bytes(r.total), f"{r.parameter_share:.1%}"] + ([format_bytes(r.peak_cuda)] if cuda else [])
            for r in ranks]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["memory per rank (tensor bytes; 'of the model': this rank's share of the parameters)"]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(cell.rjust(w) if i else cell.ljust(w)
                                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def to_json(ranks: Sequence[RankMemory], strategy: str) -> str:
    """``memory.json``: the strategy and every rank's numbers, in bytes."""
    return json.dumps({"strategy": strategy, "world_size": len(ranks), "unit": "bytes",
                       "ranks": [{**asdict(r), "total": r.total} for r in ranks]}, indent=1) + "\n"


def write_json(path: Path, ranks: Sequence[RankMemory], strategy: str) -> None:
    from scaleloop.output.rundir import write_atomic

    write_atomic(path, to_json(ranks, strategy).encode())
