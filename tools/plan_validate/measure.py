"""The plan against measurement: run a layout on N CPU processes (real Gloo groups, the real
strategies) and measure each rank's peak tensor memory and the step time.

**How the peak is measured.** The CPU has no ``max_memory_allocated``. Each worker builds the
model and runs its steps under ``torch.profiler`` with ``profile_memory=True``: torch's CPU
allocator then keeps a running total of the bytes it handed out and not yet got back, and the
profiler records that total ("Total Allocated") at every allocation and free, with a
timestamp. The rank's peak is the highest total during the steps after the first (when the
optimizer state exists), less the total when the profiler started. It counts every tensor the
rank allocates (parameters, gradients, optimizer state, activations, temporaries, DDP's
buckets, FSDP's gathered units); not torch's libraries or the Python heap.

**Frees in other threads.** The allocator keeps that total only for threads the profiler is
enabled in, unless c10's flag ``caffe2_report_cpu_memory_usage`` is set: a tensor the main thread
allocated and Gloo's worker thread freed (the last reference to a finished collective's buffers
often drops there) was then never taken off, and the total crept up by about one activation a
step under tensor parallelism, by a different amount every run. The workers set the flag
(``count_frees_in_every_thread``; it has no other effect at the default log level), and the peak
is then that of the same rank on a fake group, or now and then one finished sum above it (a
buffer Gloo's thread has not let go of yet at the peak: 3 runs of 15 of a tiny tp=2 run).

**How the step is timed.** Separately, without the profiler (which slows every op): the same
processes build the model again and run ``warmup`` untimed then ``steps`` timed steps; the time
is rank 0's wall time per step between two barriers (validate times the layouts in turns instead,
:mod:`plan_validate.turns`). With ``fabric``, the launch also measures the collectives
between bursts of compute and the plain model's step while every rank steps at once: what the
ranks get of the cores.

**A fake group** (``group="fake"``). One process runs rank 0 of the layout on PyTorch's fake
process group, whose collectives end as they are issued: no finished collective is ever held
by another thread, so its peak is the floor of what a real group reaches (FSDP and tensor
parallelism; DDP and the pipeline do not run on it). Step times from it mean nothing.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Sequence

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec
from scaleloop.plan.stepping import build_run, fake_group, run_steps, token_dataset


def count_frees_in_every_thread() -> bool:
    """Make torch's CPU allocator keep its running total in every thread (see the module
    docstring); False where this torch has no such flag (the total then misses some frees)."""
    import ctypes
    import os

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    return True


_MARK = "scaleloop.plan: measured steps"


def _peak(prof: Any) -> tuple[int, int]:
    """The most tensor bytes alive during the marked steps: the CPU allocator's own running total
    ("Total Allocated" of every allocation and free the profiler recorded), less what it held when
    the profiler started; and the total at the end of those steps (what stays between steps)."""
    import json
    import os
    import tempfile

    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    # In the order they happened (the trace lists each thread's events apart).
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    mark = next(e for e in events if e.get("name") == _MARK and e.get("ph") == "X")
    start, end = mark["ts"], mark["ts"] + mark["dur"]
    before = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"] if memory else 0
    during = [e["args"]["Total Allocated"] for e in memory if start <= e["ts"] <= end] or [before]
    return max(during) - before, during[-1] - before


def _profiled_peak(model_spec: ModelSpec, plan: Layout, env: Any, batch_size: int) -> tuple[int, int]:
    """This rank's peak and what stays between steps, over two steps after the first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dataset = token_dataset(model_spec, batch_size)
    if not count_frees_in_every_thread():
        import warnings
        warnings.warn("this torch's CPU allocator cannot count frees in other threads: peaks may read high")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        built = build_run(model_spec, plan, env, dataset, batch_size)
        run_steps(*built, 1)                   # the first step creates the optimizer state
        with torch.profiler.record_function(_MARK):
            run_steps(*built, 2)
        del built
    return _peak(prof)


def fake_group_worker(spec: dict[str, Any], layout: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Rank 0 of ``layout`` alone, on a fake process group: its peak with collectives that end as
    they are issued."""
    plan = Layout(**layout)
    with fake_group(plan.world) as env:
        peak, rest = _profiled_peak(ModelSpec(**spec), plan, env, batch_size)
    return {"peaks": [peak], "rests": [rest], "step_s": None, "world": plan.world, "fabric": None}


def measure_worker(spec: dict[str, Any], layout: dict[str, Any], batch_size: int, steps: int,
                   warmup: int, fabric: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """One rank's part (run by ``scaleloop.launch`` in every process): its peak and the step time."""
    from scaleloop.runtime.collectives import barrier, gather_object
    from scaleloop.runtime.dist import DistEnv, init_process_group

    env = DistEnv.from_env(timeout_s=timeout_s)
    init_process_group(env)
    model_spec, plan = ModelSpec(**spec), Layout(**layout)
    peak, rest = _profiled_peak(model_spec, plan, env, batch_size)
    dataset = token_dataset(model_spec, batch_size)
    built = build_run(model_spec, plan, env, dataset, batch_size)
    run_steps(*built, warmup)
    barrier(env)
    t0 = time.perf_counter()
    run_steps(*built, steps)
    barrier(env)
    step_s = (time.perf_counter() - t0) / steps
    del built
    return {"peaks": gather_object(peak, env), "rests": gather_object(rest, env), "step_s": step_s, "world": env.world_size,
            "fabric": _fabric(env) if fabric else None,
            "busy_step_s": _busy_plain_step_s(model_spec, batch_size // env.world_size, env) if fabric else None}


def plain_step_s(spec: ModelSpec, micro_batch: int, steps: int = 5) -> float:
    """Seconds of ``spec``'s TinyGPT training step with Adam, no strategy and no communication, on
    ``micro_batch`` samples in this process (the median of ``steps``, after one)."""
    import statistics

    import torch

    from scaleloop.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(spec.vocab_size, spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randint(0, spec.vocab_size, (max(1, micro_batch), spec.seq_len))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _busy_plain_step_s(spec: ModelSpec, micro_batch: int, env: Any) -> float:
    """:func:`plain_step_s` while every rank steps at once: the compute as the ranks get it when
    they share the cores."""
    from scaleloop.runtime.collectives import barrier

    barrier(env)
    seconds = plain_step_s(spec, micro_batch)
    barrier(env)
    return seconds


#: Floats in the all-reduce that stands for a step's data-carrying collectives: enough that every
#: step of a ring over a few ranks carries some (Gloo skips the empty ones of a 1-float sum).
DATA_NUMEL = 16384


def _fabric(env: Any) -> dict[str, float]:
    """All-reduce timings of one float and of 4 MiB over the group (best of 10), for
    ``costmodel.fit_fabric``: the latency and bandwidth of Gloo on this machine; and what one
    all-reduce adds between bursts of compute, as a step's collectives come: with more ranks
    than cores, each waits until its peers are scheduled again, once per step of its ring. Of
    one float (``busy_small_s``: scaleloop's own agreements) and of :data:`DATA_NUMEL` floats
    (``busy_data_s``: the collectives that carry tensors, whose every ring step waits), over
    all ranks, (``busy_pairs_*``) over pairs running at once, and (``busy_cross_*``, 4 ranks or
    a multiple) over the crossing pairs of a 2-D mesh, rows and columns in turn."""
    import torch
    import torch.distributed as torch_dist

    out: dict[str, float] = {"world_size": env.world_size}
    for key, numel in (("small", 1), ("grad", 2**20)):
        x = torch.zeros(numel)
        best = float("inf")
        for _ in range(10):
            torch_dist.barrier()
            t0 = time.perf_counter()
            torch_dist.all_reduce(x)
            best = min(best, time.perf_counter() - t0)
        out[f"{key}_s"], out[f"{key}_bytes"] = best, 4.0 * numel
    out["busy_small_s"] = _busy_collective_s(torch, torch_dist)
    out["busy_data_s"], out["data_bytes"] = _busy_collective_s(torch, torch_dist, numel=DATA_NUMEL), 4.0 * DATA_NUMEL
    if env.world_size >= 4 and env.world_size % 2 == 0:
        # Pairs, all at once, as a layout's groups of two run (tp=2, hsdp's shards and replicas).
        pairs = [torch_dist.new_group([r, r + 1], timeout=env.group_timeout) for r in range(0, env.world_size, 2)]
        pair = pairs[env.rank // 2]
        out["busy_pairs_s"] = _busy_collective_s(torch, torch_dist, groups=(pair,))
        out["busy_pairs_data_s"] = _busy_collective_s(torch, torch_dist, groups=(pair,), numel=DATA_NUMEL)
        if env.world_size % 4 == 0:
            # The pairs of a 2-D mesh (hsdp, fsdp x tp, pp x dp): a rank sums with its row's
            # partner, then with its column's (rank ^ 2); a late rank holds up both.
            columns = {r: torch_dist.new_group([r, r ^ 2], timeout=env.group_timeout) for r in range(env.world_size) if r < r ^ 2}
            crossed = (pair, columns[min(env.rank, env.rank ^ 2)])
            out["busy_cross_s"] = _busy_collective_s(torch, torch_dist, groups=crossed)
            out["busy_cross_data_s"] = _busy_collective_s(torch, torch_dist, groups=crossed, numel=DATA_NUMEL)
    return out


def _busy_collective_s(torch: Any, torch_dist: Any, rounds: int = 20, groups: Sequence[Any] = (None,),
                       numel: int = 1) -> float:
    """Seconds one all-reduce of ``numel`` floats adds to a burst of about 2 ms of compute on every
    rank: the same bursts timed with and without it (the median of three tries of ``rounds``
    each). The all-reduces go over ``groups`` in turn (None: all ranks)."""
    a, x = torch.randn(128, 128), torch.zeros(numel)

    def bursts(collective: bool) -> float:
        torch_dist.barrier()
        t0 = time.perf_counter()
        for i in range(rounds):
            for _ in range(10):
                a @ a
            if collective:
                torch_dist.all_reduce(x, group=groups[i % len(groups)])
        torch_dist.barrier()
        return time.perf_counter() - t0

    added = sorted((bursts(True) - bursts(False)) / rounds for _ in range(3))[1]
    return max(0.0, added)


def measure(spec: ModelSpec, layout: Layout, batch_size: int, steps: int = 5, warmup: int = 2,
            fabric: bool = False, timeout_s: float = 300, group: str = "gloo") -> dict[str, Any]:
    """Run ``layout`` on its number of CPU processes; every rank's peak bytes and the step time
    (and, with ``fabric``, all-reduce timings for the link's latency and bandwidth).
    ``timeout_s``: how long a collective may wait before the group gives up. ``group="fake"``:
    rank 0's peak alone, with synchronous collectives, in one process (see the module docstring)."""
    from scaleloop.launching.spawn import launch

    if group == "fake":
        return launch(fake_group_worker, 1, threads=1, args=(asdict(spec), asdict(layout), batch_size))
    if group != "gloo":
        raise ValueError(f"group must be 'gloo' or 'fake', not {group!r}")
    return launch(measure_worker, layout.world, threads=1,
                  args=(asdict(spec), asdict(layout), batch_size, steps, warmup, fabric, timeout_s))
