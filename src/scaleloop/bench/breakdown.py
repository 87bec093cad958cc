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

   Compute (forward + backward compute + optimizer) is split once more where the training
   thread's CPU time was read: wall time minus CPU time is time the thread was **off its
   core** (on a shared machine: runnable, waiting for a core that another process or thread
   held); the rest is the same work taking more CPU time (caches, memory bandwidth).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from scaleloop.bench.report import Column, Table, fmt_ratio

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
    off_core = None
    if split and bn.get("compute_cpu_s") is not None and b1.get("compute_cpu_s") is not None:
        def off(b: Mapping[str, Any]) -> float:
            return b["forward_s"] + b["backward_compute_s"] + b["optimizer_s"] - b["compute_cpu_s"]

        off_core = off(bn) - f * off(b1)
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
        # Of compute: more time with the training thread off its core than at 1 worker.
        "compute_off_core_s": off_core, "compute_off_core_points": off_core / tn if off_core is not None else None,
    }


def target_notes(target: Optional[float], points: Sequence[Mapping[str, Any]],
                 attribution: Sequence[Mapping[str, Any]]) -> list[str]:
    """Whether each N-worker point (``points[1:]``) reaches ``target``; the causes of what it lost."""
    if target is None:
        return []
    notes = []
    for p, a in zip(points[1:], attribution):
        spread = (f", per repetition {p['efficiency_min']:.2f} - {p['efficiency_max']:.2f}"
                  if len(p["repetitions"]) > 1 else "")
        met = p["efficiency"] >= target
        text = (f"Target scaling efficiency {target:.2f} at {p['workers']} workers: "
                f"{'met' if met else 'NOT met'} (median {p['efficiency']:.2f}{spread}).")
        lost = [(label, a["points"][key]) for key, label in COMPONENTS
                if a["points"][key] is not None and a["points"][key] > 0.005]
        if lost:
            lost.sort(key=lambda kv: -kv[1])
            text += " Efficiency lost, by cause, in percentage points: " + ", ".join(
                f"{label} {100 * v:.1f}" for label, v in lost) + "."
        off = a.get("compute_off_core_points")
        if off is not None and off > 0.005:
            text += (f" Of the compute, {100 * off:.1f} points are time the training thread spent off its core "
                     "(more than at 1 worker): waiting for a core that other processes or threads held.")
        notes.append(text)
    return notes


def table(attribution: Sequence[Mapping[str, Any]]) -> Table:
    """Per N: the step time perfect scaling allows, the measured one, and where the difference went."""
    rows = []
    for a in attribution:
        row: dict[str, Any] = {"workers": a["workers"], "ideal": a["ideal_step_s"] * 1e3, "step": a["step_s"] * 1e3,
                               "efficiency": a["efficiency"]}
        for key, _label, _parts in KINDS:
            sec, pts = a["kinds_s"][key], a["kinds_points"][key]
            row[key] = None if sec is None else f"{sec * 1e3:+.2f} ({100 * pts:+.1f})"
        off = a.get("compute_off_core_s")
        row["off_core"] = None if off is None else f"{off * 1e3:+.2f} ({100 * a['compute_off_core_points']:+.1f})"
        rows.append(row)
    columns = [Column("workers", "workers"), Column("ideal", "ideal step ms", lambda v: f"{v:.2f}"),
               Column("step", "measured step ms", lambda v: f"{v:.2f}"),
               Column("efficiency", "efficiency (step times)", fmt_ratio)]
    columns += [Column(key, f"{label} ms (points)") for key, label, _parts in KINDS]
    columns.insert(6, Column("off_core", "of compute: thread off its core ms (points)"))
    return Table("Why not N x one worker: extra time per step, by cause", columns, rows,
                 "ideal = the 1-worker step time x (per-worker batch at N / at 1); each cause is its time at N minus "
                 "that share of its time at 1 worker (communication and waiting: their time at N), in ms per step "
                 "and in points of efficiency (ms / measured step); they add up to 1 - efficiency. compute = "
                 "forward + backward compute + optimizer, of which 'off its core' is wall minus the training thread's CPU "
                 "time (waiting for a core); idle = waiting for the slowest worker + between steps (each "
                 "part on its own: the notes and the JSON's 'attribution'). "
                 "A negative value: that phase ran faster than at 1 worker (noise, or less contention). Where "
                 "backward cannot be split (FSDP, CUDA), its communication is counted in compute and "
                 "communication shows '-'.")
