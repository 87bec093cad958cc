"""The instrumented training step, run by each worker: throughput, a step-time breakdown, and
what is communicated.

It trains through the public strategy API, as ``scaleloop.loop.training.train`` does, with timers
around each phase (data wait, forward, backward, optimizer) and a DDP communication hook that
counts and times the all-reduces. Started under torchrun by ``bench/launcher.py``; rank 0
writes the result. The phases and measurements: docs/benchmarking.md, "The step-time breakdown".
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as torch_dist

from scaleloop.bench.breakdown import split_backward
from scaleloop.bench.stats import interval_union, summarize
from scaleloop.bench.workload import RunSpec, Workload, grad_bytes
from scaleloop.loop.step import Observer, steps_of, train_step
from scaleloop.runtime.collectives import barrier, gather_object
from scaleloop.runtime.dist import DistEnv, end_process_group, init_process_group
from scaleloop.runtime.frames import note_where
from scaleloop.strategies.registry import REGISTRY, Registered
from scaleloop.errors import UsageError

PROGRESS_PREFIX = "bench-worker:"
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s")

Say = Callable[[str], None]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a timer reads when the work ended, not when it was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class CommRecorder:
    """Bytes and in-flight time of the gradient all-reduces of each step.

    For DDP it is a communication hook that wraps PyTorch's default all-reduce hook; for the
    hand-written ``allreduce`` strategy it wraps the strategy's ``sync_gradients`` hook.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.attached = False   # a hook or wrapper is in place: steps are recorded
        self.active = False
        self._lock = threading.Lock()   # Gloo completes futures on its own threads
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0
        self._buckets = 0
        self._last_launch: Optional[tuple[float, float]] = None   # (wall, thread CPU time)
        self.steps: list[tuple[float, int, int]] = []   # (in-flight seconds, bytes, buckets)

    def _record(self, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self._bytes += nbytes
            self._buckets += 1

    def _launched(self, start: float) -> None:
        # Called on the training thread (DDP runs its hooks in backward on the CPU), so its
        # CPU time here is the training thread's at the end of backward's computation.
        cpu = time.thread_time()
        with self._lock:
            if self._last_launch is None or start >= self._last_launch[0]:
                self._last_launch = (start, cpu)

    def last_launch(self) -> Optional[tuple[float, float]]:
        """Wall and thread CPU time of the step's last all-reduce launch (None: none yet in this step)."""
        with self._lock:
            return self._last_launch

    def end_step(self) -> None:
        """Close the step: what was reduced during it becomes one entry of ``steps``."""
        with self._lock:
            if self.active and self.attached:
                self.steps.append((interval_union(self._intervals), self._bytes, self._buckets))
            self._intervals, self._bytes, self._buckets = [], 0, 0
            self._last_launch = None

    # No annotations: DDP inspects a hook's signature and rejects any bucket annotation but the
    # GradBucket class itself, which `from __future__ import annotations` turns into a string.
    def ddp_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """A DDP communication hook: PyTorch's default all-reduce, timed and counted."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        start = time.perf_counter()
        self._launched(start)
        fut = allreduce_hook(state, bucket)

        def done(f):  # type: ignore[no-untyped-def]
            self._record(start, time.perf_counter(), nbytes)
            return f.value()

        return fut.then(done)

    def wrap_gradient_sync(self, strategy: Any, model: torch.nn.Module) -> None:
        """Time the explicit all-reduce that ``allreduce`` runs after backward
        (``Registered.reduces_in_sync_gradients``)."""
        inner = strategy.sync_gradients
        nbytes = grad_bytes(model)

        def timed() -> None:
            if self.active:
                synchronize(self.device)
            start = time.perf_counter()
            self._launched(start)
            inner()
            if self.active:
                synchronize(self.device)
            self._record(start, time.perf_counter(), nbytes if strategy.env.is_distributed else 0)

        strategy.sync_gradients = timed  # an instance attribute wins over the method


def _endless(loader: Any) -> Iterator[list[Any]]:
    """The loader's steps (their micro-batches), epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from steps_of(loader)
        epoch += 1


class _PhaseTimer(Observer):
    """Marks, inside ``train_step``, the phases of a step: its compute's start, the end of the
    forward pass (the loss is known), the end of the backward and the end of the update. Each
    mark waits for the device first, so that it reads when the work ended."""

    def __init__(self, device: torch.device, recorder: CommRecorder) -> None:
        self.device, self.recorder = device, recorder
        self.start = self.forward_end = self.backward_end = self.update_end = (0.0, 0.0)   # (wall, thread CPU)
        self.launch: Optional[tuple[float, float]] = None   # the step's last all-reduce launch

    def _mark(self) -> tuple[float, float]:
        synchronize(self.device)
        return time.perf_counter(), time.thread_time()

    def micro_batch(self, batch: Any) -> None:
        self.start = self._mark()

    def forward_done(self, loss: torch.Tensor) -> None:
        self.forward_end = self._mark()

    def micro_done(self, batch: Any, loss: Optional[torch.Tensor]) -> None:
        self.backward_end = self._mark()
        self.launch = self.recorder.last_launch()

    def stepped(self) -> None:
        self.update_end = self._mark()


class _TimedSteps:
    """Runs the run's ``train_step`` over an endless loader, with or without per-phase timers."""

    def __init__(self, built: Any, env: DistEnv, recorder: CommRecorder, say: Say, label: str) -> None:
        self.built, self.env, self.recorder, self.say, self.label = built, env, recorder, say, label
        self.device = env.device
        self.timer = _PhaseTimer(self.device, recorder)
        self.steps = _endless(built.loader)
        self.last_loss: Optional[torch.Tensor] = None   # None on a rank that computes no loss (a pipeline stage)
        self.done = 0   # steps run so far, warm-up included: a failure report names the step

    def run(self, count: int, phases: bool, what: str) -> tuple[float, list[dict[str, Any]]]:
        """Run ``count`` steps; returns the elapsed seconds and, with ``phases``, per-step timings."""
        device = self.device
        records: list[dict[str, Any]] = []
        barrier(self.env)
        synchronize(device)
        started = time.perf_counter()
        marks = {max(1, count * q // 4) for q in range(1, 5)}
        try:
            self._steps(count, phases, what, marks, records)
        except Exception as exc:
            note_where(exc, None, self.done + 1)   # the step it failed in, for the launcher's report
            raise
        synchronize(device)
        return time.perf_counter() - started, records

    def _steps(self, count: int, phases: bool, what: str, marks: set[int], records: list[dict[str, Any]]) -> None:
        recorder, timer = self.recorder, self.timer
        watch = timer if phases else Observer()   # the timers synchronise: only where phases are asked for
        for i in range(count):
            t0 = time.perf_counter()
            micro_batches = next(self.steps)
            losses, _ = train_step(self.built, micro_batches, watch)
            recorder.end_step()
            if losses[-1] is not None:
                self.last_loss = losses[-1]
            if phases:
                records.append(_phases(t0, timer))
            if i + 1 in marks:
                self.say(f"{self.label}: {what} step {i + 1}/{count}")
            self.done += 1


def _phases(t0: float, timer: _PhaseTimer) -> dict[str, Any]:
    """One step's phases from its marks (a step of one micro-batch, as the bench's workloads are)."""
    (t1, c1), (t2, c2), (t3, c3), (t4, c4) = timer.start, timer.forward_end, timer.backward_end, timer.update_end
    launch = timer.launch
    if t2 < t1:
        # No loss computed here in this micro-batch (a pipeline's earlier stage, whose forwards and
        # backwards interleave in the schedule): the backward column holds both.
        t2, c2 = t1, c1
    # CPU time of the compute phases: backward's up to its last all-reduce launch.
    backward_cpu = (launch[1] if launch is not None and t2 <= launch[0] <= t3 else c3) - c2
    return {"data_s": t1 - t0, "forward_s": t2 - t1, "backward_s": t3 - t2,
            "optimizer_s": t4 - t3, "step_s": t4 - t0,
            "compute_cpu_s": (c2 - c1) + backward_cpu + (c4 - c3),
            "marks": (t2, t3, launch[0] if launch is not None else None)}


def _registered(run: RunSpec) -> Registered:
    """The registry's entry for ``run``'s strategy (``mesh:fsdp=2,tp=2``: the mesh strategy's)."""
    return REGISTRY[run.strategy.partition(":")[0]]


def _attach_comm_recorder(built: Any, run: RunSpec, env: DistEnv, recorder: CommRecorder) -> str:
    """Put the recorder where this strategy's gradient all-reduce happens; returns how it is timed."""
    if isinstance(built.model, torch.nn.parallel.DistributedDataParallel):
        built.model.register_comm_hook(state=None, hook=recorder.ddp_hook)
        recorder.attached = True
        return "DDP communication hook"
    if _registered(run).reduces_in_sync_gradients:
        recorder.wrap_gradient_sync(built.strategy, built.model)
        recorder.attached = env.is_distributed
        return "timed gradient all-reduce (explicit, after backward)"
    return f"not timed for {run.strategy}" if env.is_distributed else "none (one process)"


def measure_run(workload: Workload, run: RunSpec, env: DistEnv, say: Say,
                allreduce_reps: int = 10) -> dict[str, Any]:
    """Train ``run`` for ``workload.warmup + workload.steps`` steps on every rank and measure it.

    Every rank must call this; every rank gets the same, rank-aggregated result.
    """
    from scaleloop.loop.build import build_run

    if run.threads is not None and env.device.type == "cpu":
        torch.set_num_threads(run.threads)
    if run.global_batch % env.world_size:
        raise UsageError(f"global batch {run.global_batch} does not split over {env.world_size} workers")
    # At least two global batches, so that every timed step is full (drop_last).
    # "mesh:fsdp=2,tp=2": a --mesh composition (bench strategies' mesh rows).
    strategy, _, mesh = run.strategy.partition(":")
    cfg = workload.to_config(strategy=strategy, mesh=mesh or None, batch_size=run.global_batch, drop_last=True,
                             n_samples=max(workload.n_samples, 2 * run.global_batch))
    built = build_run(cfg, env)
    recorder = CommRecorder(env.device)
    comm_method = _attach_comm_recorder(built, run, env, recorder)
    built.model.train()
    steps = _TimedSteps(built, env, recorder, say, run.label)
    steps.run(workload.warmup, phases=False, what="warm-up")
    # On the CPU the phase timers cost nothing, so one pass gives throughput and breakdown.
    # On an accelerator the synchronising timers would slow the step: a separate pass.
    separate = env.device.type != "cpu"
    recorder.active = not separate
    elapsed, records = steps.run(workload.steps, phases=not separate, what="timed")
    if separate:
        recorder.active = True
        _, records = steps.run(workload.steps, phases=True, what="breakdown")
    recorder.active = False
    ranks = gather_object(_local_result(elapsed, records, recorder, steps.last_loss, env.device), env)
    # The same size on every rank (the all-reduce benchmark is a collective): a pipeline's stages
    # hold different parts of the model, so the largest stage's.
    nbytes = max(gather_object(grad_bytes(built.strategy.unwrap(built.model)), env))
    bench = allreduce_benchmark(nbytes, env, allreduce_reps) if env.is_distributed else None
    comm = {"method": comm_method, "grad_bytes": nbytes,
            "reduced_bytes_per_step": ranks[0]["reduced_bytes_per_step"],
            "buckets_per_step": ranks[0]["buckets_per_step"]}
    units = getattr(built.strategy, "units", None)
    factor = _registered(run).allreduce_equivalents
    if factor and env.is_distributed and units:
        # Collectives other than all-reduces (FSDP's all-gathers and reduce-scatters), untimed during
        # training: their bytes and calls per step in all-reduce equivalents (Registered.allreduce_equivalents).
        comm.update(allreduce_equivalent_bytes=factor * nbytes, buckets_per_step=factor * units)
    built.strategy.close()
    return _combine(ranks, workload, run, env, comm, bench, built.strategy.describe())


def _local_result(elapsed: float, records: list[dict[str, Any]], recorder: CommRecorder,
                  last_loss: Optional[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """This rank's measurements, to be gathered."""
    timed = bool(recorder.steps)
    return {
        "elapsed_s": elapsed,
        "phases": {k: summarize([r[k] for r in records])["mean"] for k in (*PHASES, "step_s")},
        "step_median_s": summarize([r["step_s"] for r in records])["median"],
        "comm_in_flight_s": (summarize([s[0] for s in recorder.steps])["mean"]
                             if timed and device.type == "cpu" else None),
        "reduced_bytes_per_step": summarize([s[1] for s in recorder.steps])["median"] if timed else None,
        "buckets_per_step": summarize([s[2] for s in recorder.steps])["median"] if timed else None,
        "loss": float(last_loss) if last_loss is not None else None,
        # Where backward's computation ended (the last all-reduce's launch), CPU only: a CUDA
        # hook runs when the kernels are queued, not when they have run.
        "marks": ([r["marks"] for r in records] if device.type == "cpu" and recorder.attached else None),
        "compute_cpu_s": summarize([r["compute_cpu_s"] for r in records])["mean"],
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }


def _combine(ranks: list[dict[str, Any]], workload: Workload, run: RunSpec, env: DistEnv,
             comm: dict[str, Any], bench: Optional[dict[str, Any]], strategy: str) -> dict[str, Any]:
    """The run's result from every rank's measurements (the same on every rank)."""
    elapsed_max = max(r["elapsed_s"] for r in ranks)

    def rank_mean(key: str) -> Optional[float]:
        values = [r[key] for r in ranks if r[key] is not None]
        return sum(values) / len(values) if values else None

    breakdown = {k: sum(r["phases"][k] for r in ranks) / len(ranks) for k in (*PHASES, "step_s")}
    if not env.is_distributed:
        breakdown.update(backward_compute_s=breakdown["backward_s"], wait_s=0.0, comm_exposed_s=0.0)
    elif all(r["marks"] for r in ranks):
        # One clock for all workers only on one machine: elsewhere the wait cannot be told apart.
        breakdown.update(split_backward([r["marks"] for r in ranks],
                                        same_clock=env.local_world_size == env.world_size))
    else:
        breakdown.update(backward_compute_s=None, wait_s=None, comm_exposed_s=None)
    # CPU time is the compute's only where the compute ran on this thread and backward is split.
    breakdown["compute_cpu_s"] = (rank_mean("compute_cpu_s")
                                  if env.device.type == "cpu" and breakdown["backward_compute_s"] is not None
                                  else None)
    return {
        "label": run.label, "strategy": strategy, "ok": True,
        "world_size": env.world_size, "device": env.device.type, "threads": run.threads,
        "global_batch": run.global_batch, "per_worker_batch": run.global_batch // env.world_size,
        "steps": workload.steps, "warmup": workload.warmup,
        "samples_per_s": run.global_batch * workload.steps / elapsed_max,
        "elapsed_s": elapsed_max,
        "step_median_s": rank_mean("step_median_s"),
        "breakdown": breakdown,
        "threads_seen": sorted({r["threads"] for r in ranks}),
        "interop_threads_seen": sorted({r["interop_threads"] for r in ranks}),
        "comm": dict(comm, in_flight_s=rank_mean("comm_in_flight_s")),
        "allreduce_bench": bench,
        # The first rank that computes a loss (a pipeline's last stage; rank 0 otherwise).
        "loss": next((r["loss"] for r in ranks if r["loss"] is not None), float("nan")),
        "loss_finite": all(math.isfinite(r["loss"]) for r in ranks if r["loss"] is not None),
    }


def allreduce_benchmark(nbytes: int, env: DistEnv, reps: int) -> dict[str, Any]:
    """Median time of a lone all-reduce of one float (latency) and of the gradient size.

    These two points fix the cost model's latency and bandwidth for this machine's fabric.
    """
    out: dict[str, Any] = {"world_size": env.world_size, "reps": reps}
    for key, numel in (("small", 1), ("grad", max(1, nbytes // 4))):
        tensor = torch.ones(numel, dtype=torch.float32, device=env.device)
        torch_dist.all_reduce(tensor)   # the first call sets up connections and buffers
        times = []
        for _ in range(reps):
            torch_dist.barrier()
            synchronize(env.device)
            start = time.perf_counter()
            torch_dist.all_reduce(tensor)
            synchronize(env.device)
            times.append(time.perf_counter() - start)
        # The slowest rank decides when a collective is over.
        ranks: list[Any] = [None] * env.world_size
        torch_dist.all_gather_object(ranks, summarize(times)["median"])
        out[f"{key}_bytes"] = numel * 4
        out[f"{key}_s"] = max(ranks)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Worker entry point: read the spec, measure every run in it, rank 0 writes the result."""
    parser = argparse.ArgumentParser(prog="python -m scaleloop.bench.worker")
    parser.add_argument("--spec", required=True, help="JSON: workload, runs, allreduce_reps")
    parser.add_argument("--out", required=True, help="where rank 0 writes the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
    workload = Workload.from_dict(spec["workload"])
    env = DistEnv.from_env(device=workload.device)
    say: Say = (lambda msg: print(f"{PROGRESS_PREFIX} {msg}", flush=True)) if env.is_main else (lambda _m: None)
    init_process_group(env)
    results = []
    failed = True
    try:
        for raw in spec["runs"]:
            run = RunSpec.from_dict(raw)
            try:
                results.append(measure_run(workload, run, env, say, spec.get("allreduce_reps", 10)))
            except UsageError as exc:
                # Raised identically on every rank (a strategy this hardware cannot run),
                # so the group stays in step; the table shows why.
                results.append({"label": run.label, "strategy": run.strategy, "ok": False, "error": str(exc)})
        failed = False
    finally:
        end_process_group(failed=failed)   # after a failure, once its error is recorded
    if env.is_main:
        out = Path(args.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"world_size": env.world_size, "runs": results}, indent=2), encoding="utf-8")
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
