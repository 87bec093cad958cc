"""Model FLOPs utilisation: FLOPs a training step needs, against what the hardware can do.

MFU = (training FLOPs per sample x samples/s) / peak FLOP/s.

- FLOPs per sample are counted, not estimated: ``torch.utils.flop_counter`` records the
  matrix multiplications, convolutions and attention of one forward and backward pass (the
  usual MFU convention: element-wise work, normalisation and the optimizer are not counted).
- The peak is the datasheet's dense tensor-core figure for known GPUs (no sparsity), and for a
  CPU, which has no datasheet figure one can rely on, the best of several large matrix
  multiplications measured here with the same thread count and dtype.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

# The datasheet peaks live with the devices (``runtime.devices``), where a training run reads them too.
from scaleloop.runtime.devices import GPU_PEAK_TFLOPS, Peak, datasheet_peak, gpu_datasheet_peak

__all__ = ["GPU_PEAK_TFLOPS", "Peak", "gpu_datasheet_peak", "train_flops_per_sample", "workload_flops_per_sample",
           "measure_matmul_peak", "peak_for", "mfu"]


def train_flops_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, info: Any) -> float:
    """FLOPs of one forward and backward pass per sample, counted on the batch ``(x, y)``."""
    from torch.utils.flop_counter import FlopCounterMode

    from scaleloop.data.batch import call_model
    from scaleloop.loop.losses import resolve_loss

    with FlopCounterMode(display=False) as counter:
        resolve_loss(None, info)(call_model(model, x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / x.shape[0]


def workload_flops_per_sample(workload: Any, batch: int = 8) -> dict[str, float]:
    """Counted training FLOPs per sample of a workload, and the 6N estimate for comparison.

    6N per input position (2 for forward, 4 for backward per parameter; positions: tokens
    for a language model, else 1) is exact for a stack of linear layers and a rough guide
    elsewhere; a large gap says the model is not matmul-over-parameters (convolutions reuse
    weights over positions; attention adds FLOPs without parameters; embeddings are lookups).
    """
    from scaleloop.bench.workload import build
    from scaleloop.models import count_parameters

    data, model = build(workload, batch)
    x, y = data.train.tensors[0][:batch], data.train.tensors[1][:batch]
    positions = data.info.input_shape[0] if data.info.task == "lm" else 1
    return {"flops_per_sample": train_flops_per_sample(model, x, y, data.info),
            "parameters": count_parameters(model),
            "six_n": 6.0 * count_parameters(model) * positions}


def _matmul_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def measure_matmul_peak(device: torch.device, precision: str = "fp32", threads: Optional[int] = None,
                        size: int = 2048, reps: int = 5) -> float:
    """The best FLOP/s of ``reps`` square matrix multiplications of side ``size`` on ``device``.

    The best, not the median: a peak is what the hardware can reach, and slower repetitions
    are interference. ``threads`` (CPU) is set for the measurement and restored after it.
    """
    from scaleloop.bench.worker import synchronize

    previous = torch.get_num_threads()
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        dtype = _matmul_dtype(precision)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        a @ b   # first call: kernel selection, allocation
        best = float("inf")
        for _ in range(reps):
            synchronize(device)
            start = time.perf_counter()
            a @ b
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        return 2 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def peak_for(device: torch.device, precision: str, threads: Optional[int] = None, quick: bool = False) -> Peak:
    """The peak to divide by: the datasheet's for a known GPU, else a measured matmul peak."""
    known = datasheet_peak(device, precision)
    if known is not None:
        return known
    size = 1024 if quick else 2048
    measured = measure_matmul_peak(device, precision, threads, size=size)
    where = f"{threads} thread" + ("" if threads == 1 else "s") if device.type == "cpu" and threads else device.type
    return Peak(measured, f"measured {size}x{size} {precision} matmul, {where}")


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak."""
    return flops_per_sample * samples_per_s / peak_flops_per_s
