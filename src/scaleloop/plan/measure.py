"""The plan against measurement: run a layout on N CPU processes (real Gloo groups, the real
strategies) and measure each rank's peak tensor memory and the step time.

**How the peak is measured.** The CPU has no ``max_memory_allocated``. Each worker runs the
steps under ``torch.profiler`` with ``profile_memory=True`` from before the model is built:
every allocation and free of torch's CPU allocator in that process's threads is recorded with
the op it happened in; their running sum, op by op, is the tensor bytes alive, and its highest
value over the steps after the first (when the optimizer state exists) is the rank's peak. It
counts what the plan predicts (parameters, gradients, optimizer state, activations, DDP's
buckets, FSDP's gathered units) and not torch's libraries, the Python heap or buffers that Gloo
allocates in its own threads. Peaks inside one op (its temporaries) are not seen.

**How the step is timed.** Separately, without the profiler (which slows every op): the same
processes build the model again and run ``warmup`` untimed then ``steps`` timed steps; the time
is rank 0's wall time per step between two barriers.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec


def _strategy(layout: Layout, env: Any) -> Any:
    from scaleloop.strategies.factory import make_strategy

    flags = layout.train_flags(env.world_size, 1)
    mesh = flags[flags.index("--mesh") + 1] if "--mesh" in flags else None
    name = "mesh" if mesh else flags[flags.index("--strategy") + 1]
    return make_strategy(name, env, "fp32", microbatches=layout.microbatches, mesh=mesh,
                         pipeline_schedule="1f1b" if layout.pp > 1 else "gpipe",
                         activation_checkpointing=layout.checkpointing, cpu_offload=layout.offload)


def _dataset(spec: ModelSpec, batch_size: int) -> Any:
    """Random token windows for a few steps (built before the profiler starts: not counted)."""
    import torch

    tokens = torch.randint(0, spec.vocab_size, (batch_size * 8, spec.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _build(spec: ModelSpec, layout: Layout, env: Any, dataset: Any, batch_size: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from scaleloop.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(spec.vocab_size, spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads)
    strategy = _strategy(layout, env)
    model, optimizer = strategy.setup(model, lambda params: torch.optim.Adam(params, lr=1e-3))
    return model, optimizer, strategy, strategy.loader(dataset, batch_size=batch_size, shuffle=False)


def _run_steps(model: Any, optimizer: Any, strategy: Any, loader: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps; the time each one ended (perf_counter)."""
    import torch

    def loss_fn(logits: Any, target: Any) -> Any:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    ends = []
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        strategy.forward_backward(model, batch, loss_fn)
        strategy.optimizer_step(optimizer)
        ends.append(time.perf_counter())
    return ends


_MARK = "scaleloop.plan: measured steps"


def _peak(prof: Any, after_us: float) -> int:
    """The highest running sum of the profiler's allocations and frees, after ``after_us``."""
    changes = sorted(((e.time_range.end, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                      for e in prof.events()), key=lambda c: c[0])
    live = peak = 0
    for end, delta in changes:
        live += delta
        if end >= after_us:
            peak = max(peak, live)
    return peak


def measure_worker(spec: dict[str, Any], layout: dict[str, Any], batch_size: int, steps: int,
                   warmup: int, fabric: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """One rank's part (run by ``scaleloop.launch`` in every process): its peak and the step time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from scaleloop.runtime.collectives import barrier, gather_object
    from scaleloop.runtime.dist import DistEnv, init_process_group

    env = DistEnv.from_env()
    init_process_group(env, timeout_s=timeout_s)
    model_spec, plan = ModelSpec(**spec), Layout(**layout)
    dataset = _dataset(model_spec, batch_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        built = _build(model_spec, plan, env, dataset, batch_size)
        _run_steps(*built, 1)                   # the first step creates the optimizer state
        with torch.profiler.record_function(_MARK):
            _run_steps(*built, 2)
        del built
    start = min(e.time_range.start for e in prof.events() if e.name == _MARK)
    peak = _peak(prof, start)
    built = _build(model_spec, plan, env, dataset, batch_size)
    _run_steps(*built, warmup)
    barrier(env)
    t0 = time.perf_counter()
    _run_steps(*built, steps)
    barrier(env)
    step_s = (time.perf_counter() - t0) / steps
    return {"peaks": gather_object(peak, env), "step_s": step_s, "world": env.world_size,
            "fabric": _fabric(env) if fabric else None}


def _fabric(env: Any) -> dict[str, float]:
    """All-reduce timings of one float and of 4 MiB over the group (best of 10), for
    ``costmodel.fit_fabric``: the latency and bandwidth of Gloo on this machine."""
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
    return out


def measure(spec: ModelSpec, layout: Layout, batch_size: int, steps: int = 5, warmup: int = 2,
            fabric: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """Run ``layout`` on its number of CPU processes; every rank's peak bytes and the step time
    (and, with ``fabric``, all-reduce timings for the link's latency and bandwidth).
    ``timeout_s``: how long a collective may wait before the group gives up."""
    from scaleloop.launching.spawn import launch

    return launch(measure_worker, layout.world, threads=1,
                  args=(asdict(spec), asdict(layout), batch_size, steps, warmup, fabric, timeout_s))
