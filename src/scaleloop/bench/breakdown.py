"""Why N workers are not N times one: the step time split into data, compute, communication and idle.

Two parts, both from measurements (no model):

1. ``split_backward`` divides each step's backward phase. DDP launches a gradient bucket's
   all-reduce as soon as the bucket's gradients are ready; the last bucket holds the first
   layers, whose gradients come last, so the step's **last launch marks where backward's
   computation ended**. The rest of the backward phase is communication the computation did
   not hide. Of that, the time until the slowest worker reached its own last launch is
   **waiting for that worker** (an all-reduce cannot finish before every worker has joined
   it): idle time from stragglers or uneven load, not transfer. The workers' timestamps are
   comparable only on one machine (one clock); elsewhere the wait is left in communication.

       backward = compute (t2 .. own last launch)
                + waiting for the slowest worker (own last launch .. latest last launch)
                + communication not hidden (latest last launch .. backward returns)

2. ``attribute`` compares an N-worker point with the 1-worker point. Perfect scaling would
   keep the step time at ``f x t1`` (``f`` = per-worker batch at N / at 1: 1 for weak scaling,
   1/N for strong), so ``t_N - f x t1`` is the time scaling lost per step, and it splits
   exactly into the phases' differences:

       data wait, forward, backward compute, optimizer (each: at N minus f x at 1)
       + communication not hidden + waiting for the slowest worker
       + between steps (the loop outside the timed phases, and the ranks' skew at the end)

   Divided by ``t_N`` each part is the efficiency it cost, in points; they sum to
   ``1 - f x t1 / t_N``, the measured efficiency computed from step times.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

Marks = Sequence[tuple[float, float, Optional[float]]]   # per step: (backward start, end, last launch)

# (key, label): the efficiency each one cost, in the order of a step.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("data", "data wait"),
    ("forward", "forward compute"),
    ("backward_compute", "backward compute"),
    ("optimizer", "optimizer"),
    ("communication", "all-reduce not hidden by backward"),
    ("idle", "waiting for the slowest worker"),
    ("between_steps", "between steps"),
)
# The four kinds of time the table groups them into.
KINDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("data", "data", ("data",)),
    ("compute", "compute", ("forward", "backward_compute", "optimizer")),
    ("communication", "communication", ("communication",)),
    ("idle", "idle", ("idle", "between_steps")),
)


def split_backward(marks_by_rank: Sequence[Marks], same_clock: bool) -> dict[str, Optional[float]]:
    """Mean seconds per step (over steps and ranks) of backward compute, waiting, and exposed comm.

    ``marks_by_rank[r][i]`` is ``(t_backward_start, t_backward_end, t_last_launch)`` of step
    ``i`` on rank ``r``; ``t_last_launch`` is None for a step that launched no all-reduce.
    ``same_clock``: the ranks' timestamps share a clock (one machine), so waits can be told apart.
    """
    steps = min((len(m) for m in marks_by_rank), default=0)
    if steps == 0:
        return {"backward_compute_s": None, "wait_s": None, "comm_exposed_s": None}
    compute = wait = exposed = 0.0
    count = 0
    for i in range(steps):
        step = [m[i] for m in marks_by_rank]
        launches = [launch for _, _, launch in step if launch is not None]
        latest = max(launches) if same_clock and len(launches) == len(step) else None
        for start, end, launch in step:
            count += 1
            if launch is None:          # nothing was communicated: all of it was compute
                compute += end - start
                continue
            launch = min(max(launch, start), end)
            compute += launch - start
            if latest is None:
                exposed += end - launch
            else:
                joined = min(max(latest, launch), end)   # every worker had launched by then
                wait += joined - launch
                exposed += end - joined
    return {"backward_compute_s": compute / count,
            "wait_s": wait / count if same_clock else None,
            "comm_exposed_s": exposed / count}


def seconds_per_step(point: Mapping[str, Any]) -> float:
    """Wall seconds per timed step, as the throughput counts them (slowest rank)."""
    return point["elapsed_s"] / point["steps"]


def attribute(base: Mapping[str, Any], point: Mapping[str, Any]) -> dict[str, Any]:
    """Split the step time ``point`` lost against perfect scaling of ``base`` (1 worker) into parts.

    Both are scaling points with ``per_worker_batch``, ``elapsed_s``, ``steps`` and a
    ``breakdown`` (``data_s``, ``forward_s``, ``backward_s``, ``optimizer_s``, ``step_s``, and
    where measured ``backward_compute_s``, ``wait_s``, ``comm_exposed_s``). Returns seconds per
    step and efficiency points per component (None where not measured).
    """
    f = point["per_worker_batch"] / base["per_worker_batch"]
    t1, tn = seconds_per_step(base), seconds_per_step(point)
    b1, bn = base["breakdown"], point["breakdown"]
    split = bn.get("backward_compute_s") is not None and b1.get("backward_compute_s") is not None
    seconds: dict[str, Optional[float]] = {
        "data": bn["data_s"] - f * b1["data_s"],
        "forward": bn["forward_s"] - f * b1["forward_s"],
        "optimizer": bn["optimizer_s"] - f * b1["optimizer_s"],
        "between_steps": (tn - bn["step_s"]) - f * (t1 - b1["step_s"]),
    }
    if split:
        seconds["backward_compute"] = bn["backward_compute_s"] - f * b1["backward_compute_s"]
        seconds["communication"] = bn["comm_exposed_s"]
        seconds["idle"] = bn.get("wait_s")    # None where the ranks' clocks differ: then in communication
    else:
        # Not split (FSDP, CUDA): backward and its communication stay one number.
        seconds["backward_compute"] = bn["backward_s"] - f * b1["backward_s"]
        seconds["communication"] = None
        seconds["idle"] = None
    ideal = f * t1
    points = {k: (v / tn if v is not None else None) for k, v in seconds.items()}
    kinds = {}
    for key, _label, parts in KINDS:
        values = [seconds[p] for p in parts if seconds[p] is not None]
        kinds[key] = sum(values) if values else None
    return {
        "workers": point["workers"], "ideal_step_s": ideal, "step_s": tn, "lost_s": tn - ideal,
        "efficiency": ideal / tn, "backward_split": split,
        "seconds": seconds, "points": points,
        "kinds_s": kinds, "kinds_points": {k: (v / tn if v is not None else None) for k, v in kinds.items()},
    }


def largest_loss(attribution: Mapping[str, Any]) -> tuple[str, float]:
    """The component that cost the most efficiency: (label, points)."""
    labels = dict(COMPONENTS)
    key, value = max(((k, v) for k, v in attribution["points"].items() if v is not None), key=lambda kv: kv[1])
    if key == "backward_compute" and not attribution["backward_split"]:
        return "backward (with its communication)", value
    return labels[key], value
