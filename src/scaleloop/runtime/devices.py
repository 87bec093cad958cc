"""Which device to train on: the tutorial's rule (CUDA, then MPS, then CPU), or the user's choice."""
from __future__ import annotations

import torch

from scaleloop.errors import UsageError


def best_device() -> torch.device:
    """CUDA if a GPU is visible, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(spec: str) -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N|mps`` into a device that exists here, or raise UsageError."""
    spec = spec.strip().lower()
    if spec == "auto":
        return best_device()
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {spec} was asked for, but CUDA is not available here "
                f"(torch {torch.__version__}); use --device cpu or auto (see: scaleloop env)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {spec}: only {count} CUDA device(s) here (cuda:0..cuda:{count - 1})")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError("--device mps was asked for, but MPS (Apple GPU) is not available here; "
                             "use --device cpu or auto (see: scaleloop env)")
        return device
    raise UsageError(f"--device {spec!r} is not supported; use auto, cpu, cuda, cuda:N or mps")


def device_for_local_rank(base: torch.device, local_rank: int) -> torch.device:
    """One GPU per process: local rank r uses ``cuda:r``; CPU and MPS are shared by all ranks."""
    if base.type == "cuda":
        if base.index is not None:
            return base
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return base


def describe_device(device: torch.device) -> str:
    """A human name: ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (8 threads)``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)
