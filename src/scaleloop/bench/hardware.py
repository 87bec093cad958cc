"""Name the hardware a benchmark ran on: for the report header and for the result's file name."""
from __future__ import annotations

import os
import platform
import re
from typing import Any

# GPU peaks and names change with every release; only these words are dropped from a GPU's
# name to make a short file-name slug ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3").
_NOISE_WORDS = ("nvidia", "geforce", "tesla")


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    """CPU cores this process may run on (the affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_hardware() -> dict[str, Any]:
    """CPU, cores, torch build and accelerators, as a plain dict (stored in every result)."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name,
                         "memory_gib": round(props.total_memory / 2**30, 1)})
    mps = getattr(torch.backends, "mps", None)
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": bool(gpus),
        "gpus": gpus,
        "mps_available": bool(mps is not None and mps.is_available()),
        "load_1m": load_average(),
    }


def load_average() -> float | None:
    """The 1-minute load average when the benchmark started (None where the OS has none).

    A benchmark shares the machine with whatever else runs; a load near the core count means
    the timings are noisy, and the report says so.
    """
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def load_line(hw: dict[str, Any]) -> str | None:
    """One line about the machine's load at the start, or None when unknown."""
    load = hw.get("load_1m")
    if load is None:
        return None
    text = f"load average when the benchmark started: {load:.2f} over {hw['cores']} cores"
    if load > 0.5 * hw["cores"]:
        text += " (other processes were running: expect noisier timings)"
    return text


def hardware_line(hw: dict[str, Any]) -> str:
    """One line for a report header; says plainly when no GPU was available."""
    text = f"{hw['cpu']}, {hw['cores']} cores; torch {hw['torch']}, Python {hw['python']}"
    if hw["gpus"]:
        names = sorted({g["name"] for g in hw["gpus"]})
        text += f"; {len(hw['gpus'])} GPU(s): {', '.join(names)}"
    else:
        text += "; no GPU (CUDA not available on this machine)"
    if hw.get("mps_available"):
        text += "; Apple MPS"
    return text


def hardware_slug(hw: dict[str, Any], device_type: str) -> str:
    """Short name for file names: ``cpu-2core``, ``1xh100-80gb-hbm3``, ``mps``."""
    if device_type == "cuda" and hw["gpus"]:
        name = hw["gpus"][0]["name"].lower()
        words = [w for w in re.split(r"[^a-z0-9]+", name) if w and w not in _NOISE_WORDS]
        return f"{len(hw['gpus'])}x{'-'.join(words) or 'gpu'}"
    if device_type == "mps":
        return "mps"
    return f"cpu-{hw['cores']}core"


def threads_text(n: int) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} thread" + ("" if n == 1 else "s")
