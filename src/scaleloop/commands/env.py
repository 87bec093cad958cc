"""What ``scaleloop env`` prints: the machine, torch build, backends and strategies.

torch is imported inside :func:`collect_env`, not at module level, so that
importing the CLI stays fast for commands that never touch torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from typing import Any, Callable

__all__ = ["collect_env", "format_env"]

from scaleloop.strategies.registry import REGISTRY, Registered


def _importable(api: str) -> bool:
    """Whether the torch API ``api`` ("module" or "module:attribute") imports here."""
    # Probing by import catches both torch builds without the feature and
    # builds where the module exists but fails to load on this platform.
    module, _, attr = api.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception:
        return False
    return not attr or hasattr(mod, attr)


def _gpus(torch: Any) -> list[dict[str, object]]:
    gpus: list[dict[str, object]] = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return gpus


def _nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        # Raised on builds without NCCL or when the library cannot be loaded.
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def _process_note(gpu_count: int, gloo: bool, nccl: bool) -> str:
    """How a strategy of one process per device runs here, given the backends."""
    if gloo and nccl and gpu_count:
        return f"one process per GPU via NCCL ({gpu_count} here), or N on CPU via Gloo"
    if gloo:
        return "N processes on CPU via Gloo, one per GPU via NCCL"
    if nccl:
        return "one process per GPU via NCCL (Gloo missing: no CPU multi-process)"
    return "needs the Gloo or NCCL backend in torch.distributed"


def _runs_here(entry: Registered, gpu_count: int, gloo: bool, nccl: bool,
               api_ok: Callable[[str], bool]) -> tuple[bool, str]:
    """Whether the strategy ``entry`` runs on this machine, and why or why not: from what its
    registry entry says it needs (``Registered.needs``)."""
    needs = entry.needs
    if not all(api_ok(api) for api in needs.apis):
        return False, needs.missing
    if needs.cuda:
        caveat = f"; {needs.caveat}" if needs.caveat else ""
        if gpu_count >= 1:
            return True, f"{gpu_count} CUDA GPU(s)" + (caveat if gpu_count == 1 else "")
        return False, "needs >= 1 CUDA GPU" + caveat
    if entry.processes == "one":
        return True, "one process on the best device"
    note = _process_note(gpu_count, gloo, nccl)
    return gloo or nccl, (f"{entry.what}: {note}" if entry.what else note)


def _strategies(gpu_count: int, gloo: bool, nccl: bool,
                api_ok: Callable[[str], bool] = lambda api: True) -> dict[str, tuple[bool, str]]:
    """Each registered strategy, in the registry's order -> (whether it runs on this machine, why or
    why not); ``api_ok`` says whether a torch API the strategy needs imports here."""
    return {name: _runs_here(entry, gpu_count, gloo, nccl, api_ok) for name, entry in REGISTRY.items()}


def collect_env() -> dict[str, object]:
    """Describe this machine and torch build as a plain dict.

    Keys: python, platform, torch, torch_cuda, cuda_available, gpu_count, gpus
    (list of dicts with index, name, memory_gib, capability), nccl_available,
    nccl_version, gloo_available, mpi_available, mps_available, cpu_count,
    cpu_affinity, torch_threads, bf16_cpu, bf16_cuda, best_device and
    strategies (name -> (runnable, reason)).
    """
    import torch
    import torch.distributed as dist

    cuda = bool(torch.cuda.is_available())
    gpus = _gpus(torch) if cuda else []
    dist_ok = dist.is_available()
    nccl = dist_ok and dist.is_nccl_available()
    gloo = dist_ok and dist.is_gloo_available()
    mpi = dist_ok and dist.is_mpi_available()
    mps_backend = getattr(torch.backends, "mps", None)
    mps = bool(mps_backend is not None and mps_backend.is_available())

    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        # sched_getaffinity does not exist on macOS or Windows.
        affinity = None

    bf16_cuda: bool | None = None
    if cuda:
        try:
            bf16_cuda = bool(torch.cuda.is_bf16_supported())
        except Exception:
            bf16_cuda = False

    best_device = "cuda" if cuda else "mps" if mps else "cpu"

    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "nccl_available": nccl,
        "nccl_version": _nccl_version(torch) if cuda and nccl else None,
        "gloo_available": gloo,
        "mpi_available": mpi,
        "mps_available": mps,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        # Every torch CPU build can compute in bf16 (emulated where the ISA lacks it).
        "bf16_cpu": True,
        "bf16_cuda": bf16_cuda,
        "best_device": best_device,
        # Every torch API a strategy needs is torch.distributed's.
        "strategies": _strategies(len(gpus), gloo, nccl, lambda api: dist_ok and _importable(api)),
    }


def _yes_no(flag: object) -> str:
    if flag is None:
        return "n/a"
    return "yes" if flag else "no"


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(key) for key, _ in rows), default=0)
    lines = [title]
    lines += [f"  {key:<{width}}  {value}".rstrip() for key, value in rows]
    return lines


def format_env(info: dict[str, Any]) -> str:
    """Render :func:`collect_env` output as plain-ASCII text in four sections."""
    cpu = str(info.get("cpu_count"))
    if info.get("cpu_affinity") is not None and info.get("cpu_affinity") != info.get("cpu_count"):
        cpu += f" ({info['cpu_affinity']} usable by this process)"

    python_rows = [
        ("python", str(info.get("python"))),
        ("platform", str(info.get("platform"))),
        ("torch", str(info.get("torch"))),
        ("torch CUDA build", str(info.get("torch_cuda") or "none (CPU-only build)")),
        ("CPU cores", cpu),
        ("torch threads", str(info.get("torch_threads"))),
    ]

    device_rows = [
        ("best device", str(info.get("best_device"))),
        ("CUDA available", _yes_no(info.get("cuda_available"))),
        ("GPU count", str(info.get("gpu_count", 0))),
    ]
    for gpu in info.get("gpus") or []:
        device_rows.append(
            (
                f"GPU {gpu['index']}",
                f"{gpu['name']}, {gpu['memory_gib']} GiB, compute {gpu['capability']}",
            )
        )
    device_rows += [
        ("MPS available", _yes_no(info.get("mps_available"))),
        ("bf16 on CPU", _yes_no(info.get("bf16_cpu"))),
        ("bf16 on CUDA", _yes_no(info.get("bf16_cuda"))),
    ]

    nccl = _yes_no(info.get("nccl_available"))
    if info.get("nccl_version"):
        nccl += f" (version {info['nccl_version']})"
    backend_rows = [
        ("NCCL", nccl),
        ("Gloo", _yes_no(info.get("gloo_available"))),
        ("MPI", _yes_no(info.get("mpi_available"))),
    ]

    strategies: dict[str, tuple[bool, str]] = info.get("strategies") or {}
    strategy_rows = [
        (name, f"{_yes_no(ok):<3}  {reason}") for name, (ok, reason) in strategies.items()
    ]

    lines: list[str] = []
    for title, rows in (
        ("Python / torch", python_rows),
        ("Devices", device_rows),
        ("Distributed backends", backend_rows),
        ("Strategies runnable here", strategy_rows),
    ):
        if lines:
            lines.append("")
        lines += _section(title, rows)
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Add ``env`` to the CLI's subparsers."""
    subparsers.add_parser("env", help="what this machine offers: torch, devices, backends, runnable strategies",
                          description="Report Python, torch, CUDA/NCCL/Gloo/MPS availability, devices, CPU "
                                      "cores, and which strategies can run here.")


def run(args: argparse.Namespace) -> int:
    print(format_env(collect_env()))
    return 0
