"""The host's own work per step: what the CPU spends on a layout apart from the math.

FSDP runs hooks around every unit (its gathers, its frees, scaleloop's agreement between the
ranks); tensor parallelism sends every op on a split layer through DTensor's dispatch. None of
it depends on the widths of the tensors, so it is measured where the math costs nothing: rank 0
of each layout runs the model's structure at tiny widths (``tiny_spec``) on PyTorch's fake
process group, whose collectives end as they are issued, in one process of its own. What a
layout adds is its step's time less that of the same tiny model trained without a strategy (with
activation checkpointing where the layout has it: the recomputed forward is the compute's).
Checkpointing's own work (its saved-tensor hooks and the recomputed forward's dispatch, which at
tiny widths about doubles a plain step's 6-11 ms here) is the plain step with it less 4/3 of the plain
step without: it comes on every layout that checkpoints, DDP's too.

Measured, not derived, and on this machine's CPU: a GPU machine's host may be faster or slower.
Not measured (0): DDP and the pipeline, which the fake group cannot run (their host work is the
plain loop's, which the compute already holds, plus per-bucket and per-piece calls). A pipeline
stage's pieces are counted from the plain pass (``HostWork.pipeline``): each of its M pieces runs
1/S of the blocks, M/S plain passes' dispatch in all. Models
other than TinyGPT are not measured: only TinyGPT can be shrunk to tiny widths here.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec

#: Blocks measured at most: a deeper model's work is this depth's, scaled by its blocks.
MEASURED_BLOCKS = 4


@dataclass(frozen=True)
class HostWork:
    """Seconds of host work one micro-batch's forward and backward (and step) adds, per layout."""

    extra_s: dict[str, float] = field(default_factory=dict)   # key(layout) -> seconds
    plain_s: float = 0.0          # the same tiny model's step without a strategy
    measured_blocks: int = 0
    blocks: int = 0
    plain_checkpointed_s: float = 0.0   # the same with activation checkpointing (0: as plain_s)

    def _deep(self, seconds: float) -> float:
        return seconds * self.blocks / self.measured_blocks if self.measured_blocks else 0.0

    def _measured(self, layout: Layout) -> float:
        # Checkpointing runs the forward's hooks and dispatch again: never less than without it
        # (the two are measured apart, and a noisy machine can invert them).
        seconds = self.extra_s.get(key(layout), 0.0)
        if layout.checkpointing:
            seconds = max(seconds, self.extra_s.get(key(replace(layout, checkpointing=False)), 0.0))
        return seconds

    def checkpointing(self, layout: Layout) -> float:
        """Activation checkpointing's own work in a micro-batch's step of ``layout`` (0 without
        it, or where not measured): the plain step with checkpointing less 4/3 of the plain step
        without (the recomputed forward's share, which the compute already holds), scaled to the
        depth; a pipeline stage runs its share of the blocks."""
        if not layout.checkpointing or not self.plain_checkpointed_s:
            return 0.0
        return self._deep(max(0.0, self.plain_checkpointed_s - self.plain_s * 4 / 3)) / layout.pp

    def extra(self, layout: Layout) -> float:
        """What ``layout`` adds to a micro-batch's step beyond its compute (0 where not measured),
        scaled to the depth: its strategy's work, and checkpointing's own where it has it."""
        return self._deep(self._measured(layout)) + self.checkpointing(layout)

    def pipeline(self, layout: Layout) -> float:
        """What a pipeline stage's pieces add to the host's work of a step beyond one plain pass
        (which the compute, measured on the plain step, holds): its ``microbatches`` pieces each
        run its share of the blocks, the plain pass's dispatch ``microbatches / pp`` times over;
        scaled to the depth (0 without a pipeline, or where nothing was measured)."""
        if layout.pp == 1:
            return 0.0
        return self._deep(self.plain_s) * max(0.0, layout.microbatches / layout.pp - 1)

    def total(self, layout: Layout) -> float:
        """The host's whole work for a micro-batch's step of ``layout`` on one rank (0 where
        nothing was measured): a pipeline stage runs its share of the blocks."""
        if not self.extra_s:
            return 0.0
        plain = self.plain_checkpointed_s if layout.checkpointing and self.plain_checkpointed_s else self.plain_s
        return self._deep(plain / layout.pp + self._measured(layout))


def key(layout: Layout) -> str:
    """The name a layout's host work is kept under (offload moves nothing on the host's side)."""
    return replace(layout, offload=False).label


def measured_by_fake_group(layout: Layout) -> bool:
    """Whether the fake group runs ``layout`` (FSDP and tensor parallelism; not DDP, not the pipeline)."""
    return layout.pp == 1 and (layout.fsdp > 1 or layout.tp > 1)


def tiny_spec(spec: ModelSpec) -> Optional[ModelSpec]:
    """``spec``'s structure at tiny widths (two per head), at most ``MEASURED_BLOCKS`` deep; None
    for a model that cannot be shrunk so."""
    if spec.model != "tinygpt":
        return None
    return replace(spec, seq_len=8, vocab_size=16, d_model=2 * spec.n_heads,
                   n_layers=min(spec.n_layers, MEASURED_BLOCKS))


def _built(spec: ModelSpec, layout: Optional[Layout], checkpointing: bool, env: Any) -> tuple[Any, ...]:
    """Rank 0 of ``layout`` (None: the plain model, no strategy) ready to step, one sample per
    data-parallel rank, its optimizer state made."""
    from scaleloop.plan.stepping import build_run, run_steps, token_dataset
    from scaleloop.runtime.dist import DistEnv

    if layout is None:
        env = DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "1"}, device="cpu")
        layout = Layout("dp", dp=1, checkpointing=checkpointing)
    built = build_run(spec, layout, env, token_dataset(spec, layout.data_ranks), layout.data_ranks)
    run_steps(*built, 1)
    return built


def host_work_worker(spec: dict[str, Any], layouts: list[dict[str, Any]], world: int, rounds: int) -> dict[str, Any]:
    """In a process of its own (it sets the default group): every layout's extra seconds. The
    layouts step in turn, ``rounds`` times, and each keeps its median: a machine whose speed
    drifts (a shared VM's does, by a third) slows them all alike."""
    import statistics

    from scaleloop.plan.stepping import fake_group, run_steps

    tiny = ModelSpec(**spec)
    with fake_group(world) as env:
        plans = [Layout(**fields) for fields in layouts]
        baselines = {False} | {p.checkpointing for p in plans}
        runs: dict[Any, tuple[Any, ...]] = {ac: _built(tiny, None, ac, env) for ac in baselines}
        runs.update({layout.label: _built(tiny, layout, layout.checkpointing, env) for layout in plans})
        times: dict[Any, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, built in runs.items():
                t0 = time.perf_counter()
                run_steps(*built, 1)
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    extra = {p.label: max(0.0, median[p.label] - median[p.checkpointing]) for p in plans}
    return {"extra": extra, "plain": median[False], "plain_checkpointed": median.get(True, 0.0)}


def measure_host_work(spec: ModelSpec, layouts: Sequence[Layout], rounds: int = 7) -> HostWork:
    """Each layout's host work on this machine (see the module docstring); empty where nothing
    can be measured. All ``layouts`` must have the same number of ranks."""
    from scaleloop.launching.spawn import launch

    tiny = tiny_spec(spec)
    wanted = list(dict.fromkeys(replace(layout, offload=False) for layout in layouts if measured_by_fake_group(layout)))
    if tiny is None or not wanted:
        return HostWork()
    worlds = {layout.world for layout in wanted}
    if len(worlds) != 1:
        raise ValueError(f"the layouts have different numbers of ranks: {sorted(worlds)}")
    found = launch(host_work_worker, 1, threads=1, args=(asdict(tiny), [asdict(layout) for layout in wanted],
                                                         worlds.pop(), rounds))
    return HostWork(found["extra"], found["plain"], tiny.n_layers, spec.n_layers, found["plain_checkpointed"])
