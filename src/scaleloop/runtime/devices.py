"""Which device to train on: the tutorial's rule (CUDA, then MPS, then CPU), or the user's choice.

:func:`choose_device` is the rule itself, a pure function of what was asked for, how many
processes share this machine and how many GPUs it has, so that a CPU test can check every case.
NCCL needs one GPU per process ("Duplicate GPU detected" otherwise), so several processes on
fewer GPUs are an error when CUDA was asked for, and run on the CPU with Gloo under ``auto``.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from scaleloop.errors import UsageError


@dataclass(frozen=True)
class DeviceChoice:
    """The device every local process starts from, and a line to print once when ``auto``
    had to choose less than the best device here (None: nothing to say)."""

    device: torch.device
    note: Optional[str] = None


def choose_device(requested: str, local_world_size: int, gpus: int, mps: bool = False) -> DeviceChoice:
    """The device for ``requested`` (``auto|cpu|cuda|cuda:N|mps``) with ``local_world_size``
    processes on a machine with ``gpus`` visible CUDA devices (0: no CUDA) and MPS or not.

    Raises ``UsageError`` (one line, with the remedy) for what cannot run here.
    """
    spec = requested.strip().lower()
    procs = "process" if local_world_size == 1 else "processes"
    if spec == "auto":
        if gpus >= 1 and local_world_size <= gpus:
            return DeviceChoice(torch.device("cuda"))
        if gpus >= 1:
            return DeviceChoice(torch.device("cpu"), (
                f"--device auto: {local_world_size} {procs} on this machine but {gpus} GPU(s), and NCCL needs "
                f"one GPU per process; training on the CPU with Gloo (--nproc {gpus} trains on the GPU)"))
        return DeviceChoice(torch.device("mps") if mps else torch.device("cpu"))
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return DeviceChoice(device)
    if device.type == "cuda":
        if gpus < 1:
            raise UsageError(
                f"--device {spec} was asked for, but CUDA is not available here "
                f"(torch {torch.__version__}); use --device cpu or auto (see: scaleloop env)")
        if device.index is not None and device.index >= gpus:
            raise UsageError(f"--device {spec}: only {gpus} CUDA device(s) here (cuda:0..cuda:{gpus - 1})")
        if device.index is not None and local_world_size > 1:
            raise UsageError(
                f"--device {spec} puts all {local_world_size} processes on one GPU, and NCCL needs one GPU per "
                f"process; use --device cuda (process r uses cuda:r), or --nproc 1")
        if local_world_size > gpus:
            raise UsageError(
                f"--device {spec} with {local_world_size} processes on this machine, but it has {gpus} GPU(s) and "
                f"NCCL needs one GPU per process; use --nproc {gpus}, or --device cpu for {local_world_size} "
                f"processes on the CPU")
        return DeviceChoice(device)
    if device.type == "mps":
        if not mps:
            raise UsageError("--device mps was asked for, but MPS (Apple GPU) is not available here; "
                             "use --device cpu or auto (see: scaleloop env)")
        return DeviceChoice(device)
    raise UsageError(f"--device {spec!r} is not supported; use auto, cpu, cuda, cuda:N or mps")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_present() -> bool:
    """Whether this machine has an NVIDIA GPU, found without starting the CUDA driver here
    (a process that starts it can no longer fork workers that use CUDA).

    NVML counts the devices without touching CUDA (torch uses it for the same reason); where
    NVML cannot be asked, the driver's device node says whether there is a GPU at all.
    """
    if not torch.backends.cuda.is_built():
        return False
    try:
        count = torch.cuda._device_count_nvml()  # -1 when NVML is not available
    except Exception:  # a private helper: any failure means "ask another way"
        count = -1
    return count > 0 if count >= 0 else os.path.exists("/dev/nvidiactl")


def mps_available() -> bool:
    """True where Apple's MPS can be used."""
    return torch.backends.mps.is_available()


def best_device() -> torch.device:
    """CUDA if a GPU is visible, else Apple's MPS, else the CPU."""
    return choose_device("auto", 1, visible_gpus(), mps_available()).device


def resolve_device(spec: str, local_world_size: int = 1) -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N|mps`` into a device that exists here, or raise UsageError.

    ``local_world_size``: the processes on this machine (see :func:`choose_device`); a note
    from ``auto`` is dropped here, :meth:`DistEnv.from_env` prints it.
    """
    return choose_device(spec, local_world_size, visible_gpus(), mps_available()).device


def check_processes_fit(spec: str, local_world_size: int) -> None:
    """Before starting ``local_world_size`` processes: raise UsageError if they cannot share
    this machine's devices as ``spec`` asks (a launcher's one-line check)."""
    choose_device(spec, local_world_size, visible_gpus(), mps_available())


def device_for_local_rank(base: torch.device, local_rank: int) -> torch.device:
    """One GPU per process: local rank r uses ``cuda:r``; CPU and MPS are shared by all ranks.

    :func:`choose_device` has already refused more processes than GPUs.
    """
    if base.type == "cuda" and base.index is None:
        return torch.device("cuda", local_rank)
    return base


def indexed(device: torch.device, current: Optional[int] = None) -> torch.device:
    """``cuda`` as ``cuda:N`` (N: ``current``, default this process's current GPU); others unchanged.

    Some APIs need the index (``init_process_group(device_id=...)`` raises "Please use a
    device_id with index" for a bare ``cuda``).
    """
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if current is None else current)


def to_cpu(state: Any) -> Any:
    """``state`` (tensors in dicts, lists, tuples) with every tensor detached and on the CPU.

    Weights written for people to load (``model.pt``) then load on any machine without
    ``map_location``, whatever device and strategy trained them.
    """
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        moved = type(state)((key, to_cpu(value)) for key, value in state.items())
        if hasattr(state, "_metadata"):   # a state_dict's module versions, read by load_state_dict
            moved._metadata = state._metadata  # type: ignore[attr-defined]
        return moved
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return state


#: What cuBLAS needs to give the same bits on every run (PyTorch's reproducibility notes).
CUBLAS_DETERMINISTIC = ":4096:8"


def use_deterministic_cuda(environ: Optional[dict[str, str]] = None) -> None:
    """Make CUDA kernels give the same bits on every run, as the CPU's do: deterministic
    algorithms (an error names any operation that has none), cuDNN without autotuning, and
    cuBLAS's fixed workspace. Slower; for a bit-level comparison on a GPU, not for training.

    Call it before the first CUDA work of the process: cuBLAS reads its workspace setting when
    it starts. ``environ`` (default ``os.environ``) receives ``CUBLAS_WORKSPACE_CONFIG``.
    """
    env = os.environ if environ is None else environ
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def describe_device(device: torch.device) -> str:
    """A human name: ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (8 threads)``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA, MPS); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work.

    A GPU runs behind the Python loop: a clock read without waiting stops with steps still
    queued and makes throughput look better than it is. On the CPU it is the plain clock.
    """
    if device.type != "cpu":
        synchronize(device)
    return time.perf_counter()


def say_once(note: Optional[str], local_rank: int) -> None:
    """Print ``note`` on the first process of each machine (a device choice concerns the machine)."""
    if note and local_rank == 0:
        print(f"scaleloop: {note}", file=sys.stderr, flush=True)


# Dense peak TFLOP/s (datasheet, SXM parts at boost clock unless named). Keys are matched as
# substrings of the CUDA device name, most specific first. bf16 also stands for fp16.
# None: the part has no such mode (V100 and T4 have no bf16; their fp16 figure is used).
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, Optional[float]]], ...] = (
    ("GH200", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("H200", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": None}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"bf16": 125.0, "tf32": None, "fp32": 15.7}),
    ("T4", {"bf16": 65.0, "tf32": None, "fp32": 8.1}),
)


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s and where the number comes from."""

    flops_per_s: float
    source: str


def gpu_datasheet_peak(name: str, precision: str) -> Optional[Peak]:
    """The datasheet dense peak for a CUDA device name and precision, or None if unknown.

    fp32 counts as TF32 when PyTorch lets matmuls use it (``torch.backends.cuda.matmul``).
    """
    mode = "bf16" if precision in ("bf16", "fp16") else "fp32"
    if mode == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        mode = "tf32"
    for key, peaks in GPU_PEAK_TFLOPS:
        peak = peaks.get(mode)
        if key.lower() in name.lower() and peak:
            return Peak(peak * 1e12, f"{key} {mode} dense, datasheet")
    return None


def datasheet_peak(device: torch.device, precision: str) -> Optional[Peak]:
    """The datasheet peak of ``device`` in ``precision``: a CUDA device of :data:`GPU_PEAK_TFLOPS`;
    None elsewhere (a CPU or MPS has no datasheet figure to rely on, an unlisted GPU none here)."""
    if device.type != "cuda":
        return None
    return gpu_datasheet_peak(torch.cuda.get_device_name(device), precision)
