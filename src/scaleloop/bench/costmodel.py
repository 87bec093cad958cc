"""A cost model of data-parallel training: ring all-reduce time, step time, scaling efficiency.

This is a MODEL, not a measurement. It says what the measured compute time per step and the
gradient bytes per step imply on a given interconnect, under stated assumptions:

- Ring all-reduce of S bytes over N workers: every byte crosses 2(N-1)/N links (reduce-scatter
  then all-gather), and each of the 2(N-1) ring steps pays one link latency, once per bucket:

      t_comm(N) = 2(N-1)/N x S / bandwidth  +  2(N-1) x latency x buckets

  Real libraries (NCCL) switch to trees at large N, which cuts the latency term to ~log N;
  the ring is the upper bound the tutorial teaches.
- Without overlap, communication adds to the step: t = data + forward + backward + comm + optimizer.
  With overlap (DDP reduces buckets while backward runs), only what backward cannot hide is
  added: t = data + forward + max(backward, comm) + optimizer.
- Weak scaling (fixed per-worker batch): efficiency = t(1) / t(N).
- Every worker's compute is the measured one: no stragglers, no network contention, the
  interconnect's full bandwidth per worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

PROJECTION_WORKERS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Interconnect:
    """A link's bandwidth per worker (one direction) and latency per ring step."""

    key: str
    name: str
    bandwidth_Bps: float
    latency_s: float
    assumption: str


# Nominal datasheet bandwidths; latencies are typical per-hop figures. Both are assumptions,
# stated in every report next to the projection.
INTERCONNECTS: tuple[Interconnect, ...] = (
    Interconnect("nvlink", "NVLink 4 / NVSwitch", 450e9, 2e-6,
                 "H100 NVLink 4: 900 GB/s per GPU both directions; all GPUs on one NVSwitch fabric "
                 "(8 in an HGX node; more only in NVL72/NVL256-class systems)"),
    Interconnect("ib-ndr", "InfiniBand NDR", 50e9, 5e-6,
                 "400 Gb/s per GPU (one NDR NIC per GPU, rail-optimised); the usual link between HGX nodes"),
    Interconnect("100gbe", "100 GbE", 12.5e9, 10e-6, "100 Gb/s per worker (RoCE)"),
    Interconnect("25gbe", "25 GbE", 3.125e9, 30e-6, "25 Gb/s per worker (TCP)"),
)

# DDP's default bucket size (bucket_cap_mb=25), for when the measured bucket count is unknown.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class StepCompute:
    """Measured seconds per step of one worker, without communication."""

    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s + self.optimizer_s

    @classmethod
    def from_breakdown(cls, breakdown: Mapping[str, float]) -> "StepCompute":
        return cls(breakdown["data_s"], breakdown["forward_s"], breakdown["backward_s"], breakdown["optimizer_s"])

    def scaled(self, factor: float) -> "StepCompute":
        """The compute of a batch ``factor`` times as large (strong scaling shrinks it)."""
        return StepCompute(self.data_s * factor, self.forward_s * factor, self.backward_s * factor,
                           self.optimizer_s)   # the optimizer's work does not depend on the batch


def ring_allreduce_s(workers: int, nbytes: float, bandwidth_Bps: float, latency_s: float,
                     buckets: int = 1) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``workers`` (0 for one worker)."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth_Bps + 2 * (workers - 1) * latency_s * max(1, buckets)


def step_time_s(compute: StepCompute, comm_s: float, overlap: bool) -> float:
    """Modelled step time: communication added after backward, or hidden behind it."""
    if overlap:
        return compute.data_s + compute.forward_s + max(compute.backward_s, comm_s) + compute.optimizer_s
    return compute.total_s + comm_s


def buckets_for(nbytes: float, measured: Optional[float] = None) -> int:
    """How many all-reduces a step issues: as measured, else DDP's default 25 MiB buckets."""
    if measured:
        return max(1, int(round(measured)))
    return max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))


def project(compute: StepCompute, nbytes: float, buckets: int,
            interconnects: Sequence[Interconnect] = INTERCONNECTS,
            workers: Sequence[int] = PROJECTION_WORKERS) -> list[dict[str, Any]]:
    """Weak-scaling efficiency at each worker count on each interconnect, with and without overlap."""
    rows = []
    for link in interconnects:
        for n in workers:
            comm = ring_allreduce_s(n, nbytes, link.bandwidth_Bps, link.latency_s, buckets)
            rows.append({
                "interconnect": link.key, "workers": n, "comm_s": comm,
                "efficiency_no_overlap": compute.total_s / step_time_s(compute, comm, overlap=False),
                "efficiency_overlap": compute.total_s / step_time_s(compute, comm, overlap=True),
            })
    return rows


@dataclass(frozen=True)
class Fabric:
    """Latency and bandwidth fitted to all-reduce timings measured on this machine."""

    bandwidth_Bps: float
    latency_s: float
    fitted_at_workers: int

    def allreduce_s(self, workers: int, nbytes: float, buckets: int = 1) -> float:
        return ring_allreduce_s(workers, nbytes, self.bandwidth_Bps, self.latency_s, buckets)


def fit_fabric(bench: Mapping[str, Any]) -> Fabric:
    """Invert the ring formula on two measured all-reduces (one float; the gradient size).

    The one-float all-reduce is all latency: latency = t_small / 2(N-1). The rest of the
    gradient-sized all-reduce is bandwidth: bandwidth = 2(N-1)/N x S / (t_grad - t_small).
    """
    n = int(bench["world_size"])
    if n < 2:
        raise ValueError("a fabric can only be fitted to an all-reduce over at least 2 workers")
    latency = bench["small_s"] / (2 * (n - 1))
    extra = bench["grad_s"] - bench["small_s"]
    size = bench["grad_bytes"] - bench["small_bytes"]
    bandwidth = 2 * (n - 1) / n * size / extra if extra > 0 else float("inf")
    return Fabric(bandwidth, latency, n)


def check_against_measured(points: Sequence[Mapping[str, Any]], fabric: Fabric) -> list[dict[str, Any]]:
    """Predict each measured multi-worker point from the 1-worker compute and the fitted fabric.

    ``points`` are scaling rows with ``workers``, ``per_worker_batch``, ``samples_per_s``,
    ``efficiency``, ``breakdown`` and ``comm``; the 1-worker row gives the compute. The error
    is predicted minus measured efficiency (in points) and the relative error of samples/s.
    """
    base = next((p for p in points if p["workers"] == 1), None)
    if base is None:
        return []
    compute_1 = StepCompute.from_breakdown(base["breakdown"])
    # The model's own 1-worker rate, so that a perfect model of N workers gives exactly the
    # measured efficiency (the measured rate also counts the few microseconds between steps).
    rate_1 = base["per_worker_batch"] / compute_1.total_s
    out = []
    for p in points:
        if p["workers"] == 1:
            continue
        n = p["workers"]
        compute_n = compute_1.scaled(p["per_worker_batch"] / base["per_worker_batch"])
        # FSDP moves more than an all-reduce; the worker states it as all-reduce equivalents.
        nbytes = p["comm"].get("allreduce_equivalent_bytes") or p["comm"]["grad_bytes"]
        comm = fabric.allreduce_s(n, nbytes, buckets_for(nbytes, p["comm"].get("buckets_per_step")))
        row: dict[str, Any] = {"workers": n, "measured_efficiency": p["efficiency"],
                               "measured_samples_per_s": p["samples_per_s"], "predicted_comm_s": comm}
        for mode, overlap in (("no_overlap", False), ("overlap", True)):
            t = step_time_s(compute_n, comm, overlap)
            rate = n * p["per_worker_batch"] / t
            eff = rate / (n * rate_1)
            row[f"predicted_efficiency_{mode}"] = eff
            row[f"error_points_{mode}"] = eff - p["efficiency"]
            row[f"error_rate_{mode}"] = rate / p["samples_per_s"] - 1
        out.append(row)
    return out


@dataclass(frozen=True)
class TargetGPU:
    """The GPU a projection is for: dense bf16 peak and memory bandwidth (datasheet figures)."""

    key: str
    name: str
    peak_flops: float
    hbm_Bps: float


TARGET_GPUS: tuple[TargetGPU, ...] = (
    TargetGPU("h100", "NVIDIA H100 SXM", 989e12, 3.35e12),
    TargetGPU("h200", "NVIDIA H200", 989e12, 4.8e12),
    TargetGPU("a100", "NVIDIA A100 SXM", 312e12, 2.0e12),
)
#: The MFU assumed when a GPU's compute time is estimated, not measured: what a well-tuned
#: bf16 transformer step reaches on an H100 (small models and convolutions reach less).
DEFAULT_TARGET_MFU = 0.4
#: Bytes an Adam step reads and writes per fp32 parameter: weight (r/w), gradient (r), two moments (r/w).
OPTIMIZER_BYTES_PER_PARAM = 28
#: The least time an eager step takes on a GPU however small the model: some tens of kernel
#: launches of a few microseconds each, and the Python between them. An assumption, stated.
MIN_GPU_STEP_S = 0.3e-3


def target_gpu(key: str) -> TargetGPU:
    """The entry of :data:`TARGET_GPUS` named ``key``."""
    for gpu in TARGET_GPUS:
        if gpu.key == key:
            return gpu
    raise ValueError(f"unknown target GPU {key!r}; known: {', '.join(g.key for g in TARGET_GPUS)}")


def estimated_compute(flops_per_sample: float, batch: int, parameters: int, gpu: TargetGPU,
                      mfu: float) -> StepCompute:
    """A step's compute on ``gpu`` from its FLOPs: ``flops x batch / (peak x mfu)``, split 1:2
    between forward and backward (backward computes two products per forward one), plus an
    optimizer step bound by memory bandwidth, and at least :data:`MIN_GPU_STEP_S` in all. An
    estimate, to be labelled as one."""
    matmul_s = flops_per_sample * batch / (gpu.peak_flops * mfu)
    optimizer_s = parameters * OPTIMIZER_BYTES_PER_PARAM / gpu.hbm_Bps
    # A tiny model is bound by launches, not FLOPs: its step takes at least MIN_GPU_STEP_S.
    matmul_s = max(matmul_s, MIN_GPU_STEP_S - optimizer_s)
    return StepCompute(0.0, matmul_s / 3, 2 * matmul_s / 3, optimizer_s)
