"""``scaleloop bench scaling``: the same workload at 1, 2, 4 ... workers.

Weak scaling (the default) keeps the per-worker batch fixed, so N workers do N times the work
per step; strong scaling keeps the global batch fixed and splits it. Either way, scaling
efficiency = samples/s at N / (N x samples/s at 1 worker): 1.0 means N workers are N times as
fast. Each worker count runs in fresh processes; on CPU each worker gets the same number of
threads as the 1-worker baseline (one by default), so that N workers use N times the cores
of the baseline, no more, and the comparison is honest on a small machine.

With ``repeats`` > 1 the worker counts are measured in interleaved repetitions (1, 2, ... then
..., 2, 1, ...), so that a busy moment of a shared machine does not land on one count only;
each point is the repetition with the median samples/s, and the efficiency of each
repetition (its N-worker run over its own 1-worker run) gives the spread. Why a point falls
short of N x one worker is split, from measurements, into data, compute, communication and
idle time per step (``bench/breakdown.py``).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from scaleloop.bench import breakdown as bd
from scaleloop.bench import costmodel, published
from scaleloop.bench.flops import mfu, peak_for, workload_flops_per_sample
from scaleloop.bench.hardware import describe_hardware, hardware_slug, load_average, threads_text
from scaleloop.bench.launcher import run_workers
from scaleloop.bench.report import (BenchReport, Column, Table, fmt_bytes, fmt_flops, fmt_int, fmt_ms, fmt_pct,
                                    fmt_rate, fmt_ratio)
from scaleloop.bench.workload import RunSpec, Workload
from scaleloop.errors import UsageError
from scaleloop.strategies.registry import REGISTRY

Say = Callable[[str], None]


@dataclass(frozen=True)
class ScalingOptions:
    workload: Workload
    workers: tuple[int, ...]
    strategy: str = "ddp"
    strong: bool = False
    batch_size: int = 64          # the batch at 1 worker (per worker for weak, global for strong)
    threads: Optional[int] = 1    # per worker, CPU only
    compute_ms: Optional[float] = None   # projection: assume this compute time per step instead
    target_gpu: str = "h100"      # projection: the GPU projected to (costmodel.TARGET_GPUS)
    target_mfu: float = costmodel.DEFAULT_TARGET_MFU   # its MFU, where compute is estimated from FLOPs
    allreduce_reps: int = 10
    repeats: int = 1              # interleaved repetitions of every worker count
    target_efficiency: Optional[float] = 0.9   # the report says whether each point reaches it
    quick: bool = False
    command: str = "scaleloop bench scaling"


def scaling_strategies() -> tuple[str, ...]:
    """The strategies scaling runs at every worker count: those bench compares (``Registered.bench``)
    that run one process per device, in the registry's order."""
    return tuple(name for name, entry in REGISTRY.items() if entry.bench and entry.processes == "many")


def check_options(opts: ScalingOptions, device_type: str, gpus: int) -> list[str]:
    """Raise UsageError for what cannot run here; return notes about what runs, but is skewed."""
    if opts.strategy not in scaling_strategies():
        raise UsageError(f"--strategy {opts.strategy!r} cannot be scaled over workers; choose one of: "
                         f"{', '.join(scaling_strategies())}")
    if opts.workers[0] != 1:
        raise UsageError("--workers must include 1: efficiency is measured against one worker")
    if opts.strong:
        bad = [n for n in opts.workers if opts.batch_size % n]
        if bad:
            raise UsageError(f"strong scaling splits --batch-size {opts.batch_size} over the workers, but it does "
                             f"not divide by {', '.join(map(str, bad))}; use a multiple of {max(opts.workers)}")
    notes = []
    if device_type == "cuda" and max(opts.workers) > gpus:
        raise UsageError(f"--workers {max(opts.workers)} needs {max(opts.workers)} GPUs, this machine has {gpus}")
    if device_type == "cpu":
        from scaleloop.bench.hardware import usable_cores

        cores = usable_cores()
        over = [n for n in opts.workers if n * (opts.threads or 1) > cores]
        if over:
            notes.append(f"{', '.join(map(str, over))} worker(s) x {opts.threads or 1} thread(s) need more than the "
                         f"{cores} cores here: those workers share cores, so their efficiency measures core "
                         "sharing, not the cost of data parallelism")
    return notes


def run_scaling(opts: ScalingOptions, say: Say) -> BenchReport:
    """Measure every worker count, then tabulate, break down, project and check the model."""
    device = torch.device(opts.workload.device)
    hw = describe_hardware()
    notes = check_options(opts, device.type, len(hw["gpus"]))
    for note in notes:
        say(f"note: {note}")

    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in opts.workers}
    for rep in range(opts.repeats):
        # Alternate the order, so that neither end of the list always runs on a warmer machine.
        order = opts.workers if rep % 2 == 0 else tuple(reversed(opts.workers))
        for n in order:
            runs[n].append(_measure(opts, device, n, rep, say))
    points = [_point(n, runs[n], runs[1]) for n in opts.workers]
    for p in points:
        say(f"  {p['workers']} worker(s): median {p['samples_per_s']:,.0f} samples/s, efficiency "
            f"{p['efficiency']:.2f}" + (f" (per repetition {p['efficiency_min']:.2f} - {p['efficiency_max']:.2f})"
                                        if opts.repeats > 1 else ""))

    say("scaling: counting FLOPs per sample and measuring the peak")
    flops = workload_flops_per_sample(opts.workload)
    peak = peak_for(device, opts.workload.precision, opts.threads, quick=opts.quick)
    for p in points:
        p["mfu"] = mfu(flops["flops_per_sample"], p["samples_per_s"], p["workers"] * peak.flops_per_s)

    projection, check, fabric, compute, buckets, source = _model(points, opts, device, flops)
    attribution = [bd.attribute(points[0], p) for p in points[1:]]
    hw["load_1m_end"] = load_average()
    report = BenchReport(
        what="scaling", title=f"Scaling: {opts.strategy}, {'strong' if opts.strong else 'weak'} scaling, "
                              f"{opts.workload.describe()}, batch {opts.batch_size} "
                              f"{'global' if opts.strong else 'per worker'}",
        hardware=hw, slug=hardware_slug(hw, device.type), command=opts.command,
        settings={"workload": opts.workload.to_dict(), "workers": list(opts.workers), "strategy": opts.strategy,
                  "mode": "strong" if opts.strong else "weak", "batch_size": opts.batch_size,
                  "threads_per_worker": opts.threads, "device": device.type, "repeats": opts.repeats,
                  "target_efficiency": opts.target_efficiency},
        tables=_tables(points, projection, check, attribution, opts, source, compute),
        quick=opts.quick,
        data={"points": points, "attribution": attribution, "flops": flops, "peak": {"flops_per_s": peak.flops_per_s, "source": peak.source},
              "model": {"compute_s": compute.total_s, "compute": compute.__dict__, "grad_bytes": points[0]["comm"]["grad_bytes"],
                        "buckets": buckets, "fabric": fabric.__dict__ if fabric else None,
                        "interconnects": [i.__dict__ for i in costmodel.INTERCONNECTS],
                        "projection": projection, "check": check, "compute_source": source,
                        "published_check": published.check_published()}},
    )
    best = points[-1]
    report.headline = (f"{best['workers']} workers: {best['samples_per_s']:,.0f} samples/s, "
                       f"{best['speedup']:.2f}x one worker, scaling efficiency {best['efficiency']:.2f}"
                       + (f" (per repetition {best['efficiency_min']:.2f} - {best['efficiency_max']:.2f})"
                          if opts.repeats > 1 else ""))
    report.notes = (notes + bd.target_notes(opts.target_efficiency, points, attribution) + _run_notes(opts, device, points, hw)
                    + _notes(opts, device, peak, fabric, compute, buckets, source) + _contention(points, check))
    return report


def _measure(opts: ScalingOptions, device: torch.device, n: int, rep: int, say: Say) -> dict[str, Any]:
    """One fresh launch of ``n`` workers; the worker's result, with the repetition and the load."""
    per_worker = opts.batch_size // n if opts.strong else opts.batch_size
    run = RunSpec(label=f"{n} worker(s)", strategy=opts.strategy,
                  global_batch=per_worker * n, threads=opts.threads if device.type == "cpu" else None)
    say(f"scaling: {n} worker(s) x {opts.strategy}, per-worker batch {per_worker}, global {per_worker * n}, "
        f"{opts.workload.warmup}+{opts.workload.steps} steps"
        + (f" (repetition {rep + 1}/{opts.repeats})" if opts.repeats > 1 else ""))
    load = load_average()
    result = run_workers(opts.workload, [run], n, say, allreduce_reps=opts.allreduce_reps)[0]
    if not result["ok"]:
        raise UsageError(f"{n} worker(s): {result['error']}")
    result.update(workers=n, repetition=rep + 1, load_1m=load)
    say(f"  {n} worker(s): {result['samples_per_s']:,.0f} samples/s")
    return result


def _point(n: int, runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median samples/s (the lower middle one of an even count), with the spread.

    Efficiency: the median points' samples/s, and per repetition against the 1-worker run of
    the same repetition (measured side by side).
    """
    ranked = sorted(runs, key=lambda r: r["samples_per_s"])
    point = dict(ranked[(len(ranked) - 1) // 2])
    base = sorted(base_runs, key=lambda r: r["samples_per_s"])[(len(base_runs) - 1) // 2]
    rates = [r["samples_per_s"] for r in runs]
    per_rep = [r["samples_per_s"] / (n * b["samples_per_s"]) for r, b in zip(runs, base_runs)]
    point.update(
        samples_per_s_min=min(rates), samples_per_s_max=max(rates),
        speedup=point["samples_per_s"] / base["samples_per_s"],
        efficiency=point["samples_per_s"] / (n * base["samples_per_s"]),
        efficiency_min=min(per_rep), efficiency_max=max(per_rep),
        repetitions=[{"repetition": r["repetition"], "samples_per_s": r["samples_per_s"], "elapsed_s": r["elapsed_s"],
                      "load_1m": r["load_1m"], "efficiency": e, "breakdown": r["breakdown"]}
                     for r, e in zip(runs, per_rep)])
    return point


def _run_notes(opts: ScalingOptions, device: torch.device, points: Sequence[dict[str, Any]],
               hw: dict[str, Any]) -> list[str]:
    notes = []
    if opts.repeats > 1:
        notes.append(f"{opts.repeats} interleaved repetitions (worker counts in alternating order); each row is the "
                     "repetition with the median samples/s, its breakdown included; 'efficiency per repetition' "
                     "divides each N-worker run by the 1-worker run of the same repetition.")
    if device.type == "cpu":
        seen = sorted({t for p in points for t in p.get("threads_seen", [])})
        if seen:
            notes.append(f"torch threads read inside every worker: {', '.join(map(str, seen))} "
                         f"(asked: {opts.threads or 1}; OMP_NUM_THREADS={opts.threads or 1} in their environment).")
    loads = [r["load_1m"] for p in points for r in p["repetitions"] if r.get("load_1m") is not None]
    if loads:
        notes.append(f"1-minute load average before each launch: {min(loads):.2f} - {max(loads):.2f} "
                     f"(start {hw.get('load_1m')}, end {hw.get('load_1m_end')}) over {hw['cores']} cores"
                     + ("; other processes shared the cores for part of the run, which lowers the multi-worker "
                        "points most" if max(loads) > 0.5 else "") + ".")
    return notes


def _contention(points: Sequence[dict[str, Any]], check: Sequence[dict[str, Any]]) -> list[str]:
    """Where the model and the measurement part, say which of its assumptions the data contradicts."""
    notes = []
    base = points[0]["breakdown"]
    for p, c in zip([p for p in points if p["workers"] > 1], check):
        if abs(c["error_points_no_overlap"]) < 0.1:
            continue
        ratio_fwd = p["breakdown"]["forward_s"] / base["forward_s"] * points[0]["per_worker_batch"] / p["per_worker_batch"]
        text = (f"At {p['workers']} workers the model misses by {c['error_points_no_overlap']:+.2f}: the forward pass "
                f"took {ratio_fwd:.1f}x its 1-worker time per sample")
        lone, flight = (p.get("allreduce_bench") or {}).get("grad_s"), p["comm"].get("in_flight_s")
        if lone and flight:
            text += f", and the all-reduce ran {flight / lone:.1f}x longer during training than alone"
        notes.append(text + ". The model assumes unchanged compute and a link of its own; here the workers, "
                     "their communication threads and any other load share the same cores.")
    return notes


def _model(points: Sequence[dict[str, Any]], opts: ScalingOptions, device: torch.device,
           flops: Mapping[str, float]):
    """Projection from the target GPU's compute time per step, and the check of the model on the
    measured points. The compute is measured where this run is on a GPU, else ``--compute-ms``,
    else estimated from the model's FLOPs, the target's peak and ``--target-mfu``; ``source``
    says which, for every table and note that shows it."""
    base = points[0]
    compute = costmodel.StepCompute.from_breakdown(base["breakdown"])
    gpu = costmodel.target_gpu(opts.target_gpu)
    if opts.compute_ms is not None:
        # Every phase stretched by the same factor to the asked total: "what if compute took X ms".
        factor = opts.compute_ms / 1e3 / compute.total_s
        compute = costmodel.StepCompute(compute.data_s * factor, compute.forward_s * factor,
                                        compute.backward_s * factor, compute.optimizer_s * factor)
        source = f"assumed: --compute-ms {opts.compute_ms:g}"
    elif device.type == "cuda":
        source = f"measured at 1 worker on {torch.cuda.get_device_name(device)}"
    else:
        batch = base["per_worker_batch"]
        compute = costmodel.estimated_compute(flops["flops_per_sample"], batch, int(flops["parameters"]), gpu,
                                              opts.target_mfu)
        source = (f"ESTIMATED, not measured: {fmt_flops(flops['flops_per_sample'])} per sample x {batch} / "
                  f"({gpu.name} {gpu.peak_flops / 1e12:g} TFLOP/s bf16 x {opts.target_mfu:.0%} MFU) + an Adam step "
                  f"at {gpu.hbm_Bps / 1e12:g} TB/s, at least {costmodel.MIN_GPU_STEP_S * 1e3:g} ms for kernel "
                  "launches (assumed)")
    multi = [p for p in points if p["workers"] > 1]
    measured_buckets = multi[-1]["comm"]["buckets_per_step"] if multi else None
    nbytes = base["comm"]["grad_bytes"]
    if multi and multi[-1]["comm"].get("allreduce_equivalent_bytes"):
        nbytes = multi[-1]["comm"]["allreduce_equivalent_bytes"]   # FSDP: 1.5 x the gradient bytes
    # A strategy that all-reduces by hand is timed as one call per step (bench/worker.py).
    one_call = REGISTRY[opts.strategy].reduces_in_sync_gradients
    buckets = costmodel.buckets_for(nbytes, 1 if one_call else measured_buckets)
    projection = costmodel.project(compute, nbytes, buckets)
    fabric = None
    check: list[dict[str, Any]] = []
    if multi and multi[0].get("allreduce_bench"):
        fabric = costmodel.fit_fabric(multi[0]["allreduce_bench"])
        check = costmodel.check_against_measured(points, fabric)
    return projection, check, fabric, compute, buckets, source


def _tables(points: Sequence[dict[str, Any]], projection: list[dict[str, Any]],
            check: list[dict[str, Any]], attribution: Sequence[dict[str, Any]], opts: ScalingOptions,
            source: str, compute: costmodel.StepCompute) -> list[Table]:
    repeated = opts.repeats > 1
    rows = [{"workers": p["workers"], "per_worker_batch": p["per_worker_batch"], "global_batch": p["global_batch"],
             "samples_per_s": p["samples_per_s"], "speedup": p["speedup"], "efficiency": p["efficiency"],
             "rate_range": f"{fmt_rate(p['samples_per_s_min'])} - {fmt_rate(p['samples_per_s_max'])}",
             "efficiency_range": (f"{p['efficiency_min']:.2f} - {p['efficiency_max']:.2f}"
                                  if p["workers"] > 1 else "-"),
             "mfu": p["mfu"]} for p in points]
    columns = [Column("workers", "workers"), Column("per_worker_batch", "per-worker batch"),
               Column("global_batch", "global batch"),
               Column("samples_per_s", "samples/s (median)" if repeated else "samples/s", fmt_rate)]
    if repeated:
        columns.append(Column("rate_range", "min - max"))
    columns += [Column("speedup", "speedup", fmt_ratio), Column("efficiency", "scaling efficiency", fmt_ratio)]
    if repeated:
        columns.append(Column("efficiency_range", "efficiency per repetition"))
    columns.append(Column("mfu", "MFU", fmt_pct))
    throughput = Table("Throughput", columns, rows,
                       "scaling efficiency = samples/s / (workers x samples/s at 1 worker)"
                       + (f"; {opts.repeats} interleaved repetitions" if repeated else ""))
    breakdown_rows = []
    for p in points:
        b, c, ar = p["breakdown"], p["comm"], p.get("allreduce_bench") or {}
        breakdown_rows.append({
            "workers": p["workers"], "step": b["step_s"], "data": b["data_s"], "forward": b["forward_s"],
            "backward": b["backward_s"], "optimizer": b["optimizer_s"],
            "backward_compute": b.get("backward_compute_s"),
            "wait": b.get("wait_s") if p["workers"] > 1 else None,
            "exposed": b.get("comm_exposed_s") if p["workers"] > 1 else None,
            "grad_bytes": c.get("reduced_bytes_per_step") if p["workers"] > 1 else None,
            "buckets": c["buckets_per_step"] if p["workers"] > 1 else None,
            "comm": c["in_flight_s"] if p["workers"] > 1 else None,
            "allreduce": ar.get("grad_s")})
    breakdown = Table("Step-time breakdown (ms per step, mean over steps and workers)", [
        Column("workers", "workers"), Column("step", "step", fmt_ms), Column("data", "data wait", fmt_ms),
        Column("forward", "forward", fmt_ms), Column("backward", "backward (with comm)", fmt_ms),
        Column("backward_compute", "of which compute", fmt_ms),
        Column("wait", "of which waiting for the slowest worker", fmt_ms),
        Column("exposed", "of which all-reduce not hidden", fmt_ms),
        Column("optimizer", "optimizer", fmt_ms), Column("grad_bytes", "bytes all-reduced / step", fmt_bytes),
        Column("buckets", "all-reduce calls / step", fmt_int),
        Column("comm", "time with all-reduce in flight", fmt_ms),
        Column("allreduce", "lone all-reduce of the gradients", fmt_ms)], breakdown_rows,
        "'time with all-reduce in flight': wall time during which at least one gradient all-reduce was running "
        "(it overlaps backward). 'lone all-reduce': the same bytes all-reduced with nothing else running. "
        "Backward is split at each step's last all-reduce launch (where its computation ended): compute, then "
        "waiting until the slowest worker had launched too, then the all-reduce that backward did not hide.")
    tables = [throughput, breakdown]
    if attribution:
        tables.append(bd.table(attribution))
    names = {i.key: i.name for i in costmodel.INTERCONNECTS}
    for mode, label in (("no_overlap", "without overlap"), ("overlap", "with communication overlapping backward")):
        by_link: dict[str, dict[str, Any]] = {}
        for r in projection:
            by_link.setdefault(r["interconnect"], {"interconnect": names[r["interconnect"]]})[f"n{r['workers']}"] = \
                r[f"efficiency_{mode}"]
        cols = [Column("interconnect", "interconnect")] + [
            Column(f"n{n}", str(n), fmt_ratio) for n in costmodel.PROJECTION_WORKERS]
        tables.append(Table(f"MODEL: projected weak-scaling efficiency, {label} (GPUs)", cols,
                            list(by_link.values()),
                            "A cost model, not a measurement: ring all-reduce of the measured gradient bytes "
                            f"on each interconnect, added to a compute time per step of "
                            f"{compute.total_s * 1e3:.3g} ms ({source})."))
    if check:
        tables.append(Table("MODEL CHECK: the cost model against the measured points", [
            Column("workers", "workers"), Column("measured_efficiency", "measured efficiency", fmt_ratio),
            Column("predicted_efficiency_no_overlap", "model, no overlap", fmt_ratio),
            Column("error_points_no_overlap", "error (no overlap)", _fmt_signed),
            Column("predicted_efficiency_overlap", "model, overlap", fmt_ratio),
            Column("error_points_overlap", "error (overlap)", _fmt_signed),
            Column("predicted_comm_s", "model all-reduce ms", fmt_ms)], check,
            "Fabric latency and bandwidth fitted to the lone all-reduces; error = model - measured efficiency."))
    tables.append(_published_table())
    return tables


def _published_table() -> Table:
    """The model's communication terms against a published table (scaleloop.bench.published)."""
    rows = published.check_published()
    return Table("MODEL CHECK: the cost model against a published scaling table", [
        Column("fabric", "assumed fabric"), Column("gpus", "GPUs"),
        Column("published_efficiency", "published efficiency", fmt_ratio),
        Column("model_no_overlap", "model, no overlap", fmt_ratio),
        Column("error_no_overlap", "error (no overlap)", _fmt_signed),
        Column("model_overlap", "model, overlap", fmt_ratio),
        Column("error_overlap", "error (overlap)", _fmt_signed),
        Column("comm_s", "model all-reduce ms", fmt_ms)], rows,
        f"{published.SEED_002.source}; {published.SEED_002.assumption}. The model overestimates efficiency by "
        f"up to {published.worst_error(rows) * 100:.0f} points there: it counts only the all-reduce, not the "
        "input pipeline, stragglers or synchronisation, so read its projections as upper bounds.")


def _fmt_signed(v: float) -> str:
    return f"{v:+.2f}"


def _notes(opts: ScalingOptions, device: torch.device, peak: Any, fabric: Optional[costmodel.Fabric],
           compute: costmodel.StepCompute, buckets: int, source: str) -> list[str]:
    notes = []
    if device.type == "cpu":
        notes.append(f"Workers are processes on the CPU (Gloo), each with {threads_text(opts.threads or 1)}, the "
                     "1-worker baseline included.")
        notes.append("No GPU was available for this run: nothing about GPUs here is measured. The projection "
                     "uses a GPU compute time estimated from the model's FLOPs, and the measured CPU step is "
                     "not used for it.")
    notes.append(f"MFU = counted training FLOPs per sample x samples/s / (workers x peak); peak per worker: "
                 f"{fmt_flops(peak.flops_per_s)}/s ({peak.source}).")
    notes.append(f"Projection inputs: compute {compute.total_s * 1e3:.3g} ms per step ({source}; backward "
                 f"{compute.backward_s * 1e3:.3g} ms), {buckets} all-reduce call(s) per step, per-GPU batch as "
                 "measured (weak scaling).")
    for link in costmodel.INTERCONNECTS:
        notes.append(f"{link.name}: {link.bandwidth_Bps / 1e9:g} GB/s per worker, {link.latency_s * 1e6:g} us per "
                     f"ring step ({link.assumption}).")
    notes.append("Ring all-reduce: 2(N-1)/N x bytes / bandwidth + 2(N-1) x latency x calls; NCCL uses trees at "
                 "large N, so the latency term is pessimistic there. Overlap hides communication behind "
                 "backward only.")
    factor = REGISTRY[opts.strategy].allreduce_equivalents
    if factor:
        notes.append(f"FSDP all-gathers parameters in forward and backward and reduce-scatters gradients: {factor:g}x "
                     "an all-reduce's bytes, 3 collectives per unit. Its bytes and calls are given in all-reduce "
                     "equivalents, and its collectives are not timed during training.")
    if fabric is not None:
        # Timing noise can make the gradient-sized all-reduce no slower than the one-float one;
        # then the bandwidth term cannot be resolved and the model treats it as free.
        bandwidth = (f"{fabric.bandwidth_Bps / 1e9:.2f} GB/s" if math.isfinite(fabric.bandwidth_Bps) else
                     "not resolvable (the gradient-sized all-reduce was no slower than the one-float one)")
        notes.append(f"This machine's fabric, fitted to the lone all-reduces at {fabric.fitted_at_workers} workers: "
                     f"latency {fabric.latency_s * 1e6:.1f} us per ring step, bandwidth {bandwidth}.")
    return notes
