"""``scaleloop bench strategies``: single vs dp vs ddp vs allreduce vs fsdp, and the ``--mesh``
compositions (tp, fsdp x tp, hsdp, dp x tp), on one workload.

Every row trains the same model on the same data with the same GLOBAL batch, so each does
the same optimisation and only the way the hardware is used differs. Rows this machine or
this version cannot run stay in the table with the reason, instead of disappearing.

On the CPU the baseline is one process with one thread, and each of N workers also gets one
thread; one process with N threads is shown too, since that is the CPU's own way of using N
cores for one model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from scaleloop.bench.hardware import describe_hardware, hardware_slug, usable_cores
from scaleloop.bench.launcher import run_workers
from scaleloop.bench.report import BenchReport, Column, Table, fmt_bytes, fmt_ms, fmt_rate, fmt_ratio
from scaleloop.bench.workload import RunSpec, Workload
from scaleloop.errors import UsageError
from scaleloop.strategies.registry import REGISTRY

Say = Callable[[str], None]


def benchmarked() -> tuple[str, ...]:
    """The strategies this benchmark compares (``Registered.bench``), in the registry's order, which
    is the tutorial's: one device (the first, the baseline), one process over several GPUs, one
    process per device."""
    return tuple(name for name, entry in REGISTRY.items() if entry.bench)


@dataclass(frozen=True)
class StrategiesOptions:
    workload: Workload
    workers: int = 2
    batch_size: int = 128        # global
    quick: bool = False
    allreduce_reps: int = 10
    command: str = "scaleloop bench strategies"


@dataclass(frozen=True)
class BenchRow:
    """One row of the table: what runs (or why it does not)."""

    label: str
    strategy: str
    processes: int
    threads: Optional[int]
    skip: Optional[str] = None


def table_rows(opts: StrategiesOptions, device_type: str, gpus: int) -> list[BenchRow]:
    """The rows for this machine, in table order."""
    n = opts.workers
    cpu = device_type == "cpu"
    base, *others = benchmarked()
    rows = [BenchRow(f"{base} (1 thread)" if cpu else f"{base} (1 GPU)", base, 1, 1 if cpu else None)]
    if cpu and n > 1:
        rows.append(BenchRow(f"{base} ({n} threads)", base, 1, n))
    for name in others:
        entry = REGISTRY[name]
        if entry.processes == "many":
            rows.append(BenchRow(f"{name} x {n}", name, n, 1 if cpu else None))
        elif entry.needs.cuda and cpu:
            what = f" ({entry.what})" if entry.what else ""
            rows.append(BenchRow(name, name, 1, None, f"needs CUDA GPUs{what}; none here"))
        elif entry.needs.cuda:
            rows.append(BenchRow(f"{name} ({gpus} GPUs, 1 process)", name, 1, None))
        else:
            rows.append(BenchRow(f"{name} (1 process)", name, 1, 1 if cpu else None))
    return rows + mesh_rows(n, 1 if cpu else None)


def mesh_rows(n: int, threads: Optional[int]) -> list[BenchRow]:
    """The ``--mesh`` compositions on ``n`` workers (the model needs a ``tp_plan()``: TinyGPT):
    tensor parallelism alone, then, from 4 workers, FSDP x TP, HSDP, replicated x TP and pipeline
    x data parallel (2 stages, each replicated; the model needs an ``as_sequential()``)."""
    rows = [BenchRow(f"tp x {n} (mesh tp={n})", f"mesh:tp={n}", n, threads,
                    None if n > 1 else "tensor parallelism needs --workers 2 or more")]
    half = n // 2
    for label, mesh in (("fsdp x tp", f"fsdp={half},tp=2"), ("hsdp", f"dp=2,fsdp={half}"),
                        ("dp x tp", f"dp={half},tp=2"), ("pp x dp", f"pp=2,dp={half}")):
        skip = None if n >= 4 and n % 2 == 0 else "needs an even --workers of 4 or more"
        rows.append(BenchRow(f"{label} (mesh {mesh})" if skip is None else label, f"mesh:{mesh}", n, threads, skip))
    return rows


def _per_worker_batch(row: BenchRow, global_batch: int, measured: int) -> int:
    """Samples each worker's forward sees: a mesh's tp ranks share theirs (the batch is split over dp x fsdp)."""
    if not row.strategy.startswith("mesh:"):
        return measured
    from scaleloop.runtime.mesh import MeshSpec

    return global_batch // MeshSpec.parse(row.strategy[5:]).data_parallel


def run_strategies(opts: StrategiesOptions, say: Say) -> BenchReport:
    device = torch.device(opts.workload.device)
    hw = describe_hardware()
    gpus = len(hw["gpus"])
    if opts.batch_size % opts.workers:
        raise UsageError(f"--batch-size {opts.batch_size} (global) does not split over --workers {opts.workers}; "
                         f"use a multiple of {opts.workers}")
    if device.type == "cuda" and opts.workers > gpus:
        raise UsageError(f"--workers {opts.workers} needs {opts.workers} GPUs, this machine has {gpus}")
    wanted = table_rows(opts, device.type, gpus)
    results: dict[str, dict[str, Any]] = {}
    # Rows with the same process count share one launch (one torchrun for all N-process rows):
    # fewer start-ups, and the runs still start from fresh models in sequence.
    for procs in sorted({p.processes for p in wanted if p.skip is None}):
        group = [p for p in wanted if p.skip is None and p.processes == procs]
        say(f"strategies: {', '.join(p.label for p in group)} ({procs} process(es))")
        runs = [RunSpec(p.label, p.strategy, opts.batch_size, p.threads) for p in group]
        for r in run_workers(opts.workload, runs, procs, say, allreduce_reps=opts.allreduce_reps):
            results[r["label"]] = r
            if r["ok"]:
                say(f"  {r['label']}: {r['samples_per_s']:,.0f} samples/s")

    rows = []
    base = results.get(wanted[0].label)
    for p in wanted:
        r = results.get(p.label, {})
        row: dict[str, Any] = {"label": p.label, "strategy": p.strategy, "processes": p.processes,
                               "threads": p.threads, "global_batch": opts.batch_size}
        if p.skip or not r.get("ok"):
            row["status"] = p.skip or r.get("error", "did not run")
        else:
            row.update(status="ran", per_worker_batch=_per_worker_batch(p, opts.batch_size, r["per_worker_batch"]), samples_per_s=r["samples_per_s"],
                       step_s=r["breakdown"]["step_s"], backward_s=r["breakdown"]["backward_s"],
                       comm_s=r["comm"]["in_flight_s"] if p.processes > 1 else None,
                       grad_bytes=r["comm"]["reduced_bytes_per_step"] if p.processes > 1 else None,
                       loss=r["loss"])
            if base and base.get("ok"):
                row["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        rows.append(row)
    table = Table("Strategies: same workload, same global batch", [
        Column("label", "strategy"), Column("processes", "processes"), Column("threads", "threads / process"),
        Column("per_worker_batch", "per-worker batch"), Column("samples_per_s", "samples/s", fmt_rate),
        Column("speedup", f"vs {wanted[0].label}", fmt_ratio), Column("step_s", "step ms", fmt_ms),
        Column("backward_s", "backward ms (with comm)", fmt_ms), Column("comm_s", "all-reduce in flight ms", fmt_ms),
        Column("grad_bytes", "bytes reduced / step", fmt_bytes), Column("status", "status")], rows,
        f"{opts.workload.describe()}, global batch {opts.batch_size}, {opts.workload.steps} timed steps "
        f"after {opts.workload.warmup} warm-up steps.")
    ran = [r for r in rows if r.get("samples_per_s")]
    best = max(ran, key=lambda r: r["samples_per_s"])
    report = BenchReport(
        what="strategies", title=f"Strategies: {opts.workload.describe()}", hardware=hw,
        slug=hardware_slug(hw, device.type), command=opts.command,
        settings={"workload": opts.workload.to_dict(), "workers": opts.workers, "batch_size": opts.batch_size,
                  "device": device.type},
        tables=[table], quick=opts.quick, data={"rows": rows, "runs": results})
    report.headline = (f"fastest: {best['label']} at {best['samples_per_s']:,.0f} samples/s"
                       + (f" ({best['speedup']:.2f}x {wanted[0].label})" if best.get("speedup") else ""))
    if device.type == "cpu":
        report.notes.append("No GPU was available for this run: dp needs CUDA, and every process runs on the CPU "
                            "(Gloo).")
        if opts.workers > usable_cores():
            report.notes.append(f"{opts.workers} workers share {usable_cores()} cores: the multi-process rows "
                                "measure core sharing.")
    return report
