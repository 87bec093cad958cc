"""The plan from end to end: profile the model once, then every candidate layout's memory and
time on the target, ranked (``scaleloop plan`` prints :func:`plan`'s report)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.plan.hostwork import HostWork, measure_host_work
from scaleloop.plan.layouts import Layout, candidates
from scaleloop.plan.memory import Options, estimate
from scaleloop.plan.profile import ModelProfile, ModelSpec, profile_model
from scaleloop.plan.report import Row, format_plan
from scaleloop.plan.target import Target
from scaleloop.plan.timing import step_time


def evaluate(profile: ModelProfile, target: Target, options: Options, mfu: float,
             measure_host: bool = False) -> tuple[list[Row], list[str]]:
    """Every candidate layout of ``target``'s GPUs with its memory, time and whether it fits; and
    the layouts left out because the batch does not split over their data-parallel ranks.
    ``measure_host``: give the times the host's work, measured here (:mod:`scaleloop.plan.hostwork`)."""
    # Tensor parallelism splits what the model's tp_plan() names; a model without one gets no tp layout.
    heads = profile.heads if profile.tp_parameters else None
    every = candidates(target.gpus, target.per_node, target.nodes, options.batch_size, heads,
                       len(profile.layers), with_checkpointing=profile.series_checkpointed is not None)
    layouts = [layout for layout in every if options.batch_size % layout.data_ranks == 0]
    left_out = [f"{layout.label}: --batch-size {options.batch_size} does not split over its {layout.data_ranks} "
                "data-parallel ranks" for layout in every if layout not in layouts]
    if not layouts:
        raise UsageError(f"--batch-size {options.batch_size} does not split over {target.gpus} GPUs in any layout: "
                         f"give a multiple of {target.gpus}")
    host: Optional[HostWork] = measure_host_work(profile.spec, layouts) if measure_host else None
    rows = []
    for layout in layouts:
        memory = estimate(profile, layout, options)
        rows.append(Row(layout, memory, step_time(profile, layout, options, target, mfu, host),
                        memory.peak <= target.memory_bytes * target.usable))
    return rows, left_out


def plan(spec: ModelSpec, target: Target, options: Options, mfu: float = 0.4, data: Optional[str] = None,
         profile: Optional[ModelProfile] = None, measure_host: bool = False, data_dir: Optional[str] = None) -> str:
    """The report for ``spec`` on ``target`` (``profile``: one already made, to skip the trace;
    ``measure_host``: the host's work per layout measured on this machine, a few seconds more;
    ``data``, ``data_dir``: the train line's, None: the user's own data, named as such)."""
    if not 0 < mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], not {mfu}")
    if options.batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, not {options.batch_size}")
    profile = profile or profile_model(spec, low_precision=options.precision in ("bf16", "fp16"))
    rows, left_out = evaluate(profile, target, options, mfu, measure_host)
    return format_plan(profile, rows, options, target, mfu, data, left_out, measure_host, data_dir)


def largest_batch(profile: ModelProfile, layout: Layout, options: Options, capacity: float,
                  cap: int = 1 << 20) -> int:
    """The largest per-device batch whose predicted peak fits in ``capacity`` bytes (0: none),
    found as ``tune-batch`` finds it on a GPU: doubling, then bisecting."""
    def fits(per_device: int) -> bool:
        batch = per_device * layout.data_ranks * options.accumulate * layout.microbatches
        return estimate(profile, layout, replace(options, batch_size=batch)).peak <= capacity

    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < cap:
        if fits(2 * good):
            good *= 2
        else:
            bad = 2 * good
    bad = bad or good + 1
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good
