"""One rank's profiled steps, read from its ``torch.profiler`` trace (Chrome trace JSON; no torch).

The profiler (``loop.profiler``) marks each profiled step with a ``scaleloop.step`` range and its
phases with ``scaleloop.data``, ``scaleloop.forward_backward``, ``scaleloop.forward``,
``scaleloop.backward`` and ``scaleloop.optimizer`` ranges on the training thread. From those and
the trace's own operators, every instant of a step gets exactly one part, the first that holds
(so the parts add up to the step time):

1. ``comm exposed``: a collective runs (any thread: ``gloo:``, ``nccl:``, ``c10d::`` operators,
   NCCL kernels) and no computing operator runs on any thread (no ``aten::`` operator or kernel
   outside a collective): the rank waits for the network;
2. ``data wait``: inside a ``scaleloop.data`` range (from the end of one step to the next
   micro-batch's forward: fetching the batch, and the loop's own work between steps);
3. ``optimizer``: inside ``scaleloop.optimizer`` (clipping, the optimizer and the schedule);
4. ``backward``: inside an autograd engine function (``autograd::engine::evaluate_function``)
   or a ``scaleloop.backward`` range;
5. ``forward``: inside ``scaleloop.forward_backward`` or ``scaleloop.forward`` (the forward and
   the loss, what of the pair is not backward);
6. ``other``: the rest of the step.

``comm overlapped`` is the collectives' time that computing covered (not a part: it hides under
the others). All times are per step, in milliseconds (the mean over the profiled steps).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

#: The parts a step is split into, in the order they claim an instant (the module doc).
PARTS = ("comm exposed", "data wait", "optimizer", "backward", "forward", "other")
#: How many operators the summary names, by self time.
TOP_OPS = 5
#: The most segments per rank kept for the picture (the shortest merge into their neighbours).
MAX_SEGMENTS = 4000

_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms", "ncclKernel", "ncclDevKernel")
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"

Intervals = list[tuple[float, float]]


def union(spans: Iterable[tuple[float, float]]) -> Intervals:
    """``spans`` as sorted, disjoint intervals."""
    out: Intervals = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The instants in both (each sorted and disjoint)."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The instants of ``a`` not in ``b`` (each sorted and disjoint)."""
    out: Intervals = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def measure(spans: Intervals) -> float:
    return sum(end - start for start, end in spans)


def is_comm(name: str) -> bool:
    """Whether an operator is a collective (or point-to-point) of the process group."""
    return name.startswith(_COMM_PREFIXES)


def analyse(trace: Path, steps: Optional[int] = None) -> dict[str, Any]:
    """One rank's numbers from its trace: steps, parts, communication, top operators, segments.

    ``steps``: how many steps ended while recording (the first ones); a step the run left
    unfinished (it ended, or failed, inside it) is not counted."""
    events = [e for e in json.loads(trace.read_text(encoding="utf-8")).get("traceEvents", [])
              if e.get("ph") == "X" and "dur" in e and "ts" in e]
    spans = lambda pick: union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if pick(e))  # noqa: E731
    # (not merged: one step's range ends where the next one's starts)
    whole = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e["name"] == "scaleloop.step")
    steps = whole[:steps] if steps is not None else whole
    if not steps:
        raise ValueError(f"{trace} holds no profiled step (no scaleloop.step range)")
    # (Gloo's collectives are user annotations on its own threads; NCCL's are kernels.)
    ops = [e for e in events if e.get("cat") in ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset")
           or (e.get("cat") == "user_annotation" and is_comm(e["name"]))]
    comm = union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ops if is_comm(e["name"]))
    compute = _compute(ops)
    phase = lambda *names: spans(lambda e: e["name"] in names)  # noqa: E731
    claims = {
        "comm exposed": subtract(comm, compute),
        "data wait": phase("scaleloop.data"),
        "optimizer": phase("scaleloop.optimizer"),
        "backward": union(spans(lambda e: e["name"].startswith(_BACKWARD_PREFIX)) + phase("scaleloop.backward")),
        "forward": phase("scaleloop.forward_backward", "scaleloop.forward"),
        "other": steps,
    }
    remaining, parts, segments = steps, {}, []
    for part in PARTS:
        mine = intersect(remaining, claims[part])
        remaining = subtract(remaining, mine)
        parts[part] = measure(mine)
        segments += [(part, start, end) for start, end in mine]
    n, origin = len(steps), steps[0][0]
    in_steps_comm = intersect(comm, steps)
    return {
        "steps": n,
        "steps_ms": [round((end - start) / 1e3, 4) for start, end in steps],
        "step_ms": measure(steps) / n / 1e3,
        "parts_ms": {part: parts[part] / n / 1e3 for part in PARTS},
        "comm_ms": measure(in_steps_comm) / n / 1e3,
        "comm_overlapped_ms": measure(intersect(in_steps_comm, compute)) / n / 1e3,
        "top_ops": top_operators(events, TOP_OPS, n),
        "step_starts_ms": [round((start - origin) / 1e3, 4) for start, _ in steps],
        "segments": _fewer([(part, round((s - origin) / 1e3, 4), round((e - origin) / 1e3, 4))
                            for part, s, e in sorted(segments, key=lambda seg: seg[1])]),
        "overlapped": [(round((s - origin) / 1e3, 4), round((e - origin) / 1e3, 4))
                       for s, e in intersect(in_steps_comm, compute)][:MAX_SEGMENTS],
    }


def top_operators(events: list[dict[str, Any]], count: int, steps: int) -> list[dict[str, Any]]:
    """The ``count`` operators of most self time (their time less their children's, per thread),
    per step, in milliseconds, with their calls per step."""
    self_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "kernel"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []   # [end, name, children's time]
        for e in thread:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _pop(stack, self_us)
            if stack:
                stack[-1][2] += dur
            stack.append([start + dur, e["name"], 0.0, dur])
            calls[e["name"]] = calls.get(e["name"], 0) + 1
        while stack:
            _pop(stack, self_us)
    ranked = sorted(self_us.items(), key=lambda item: -item[1])[:count]
    return [{"name": name, "self_ms": us / steps / 1e3, "calls": calls[name] / steps} for name, us in ranked]


def _pop(stack: list[list[Any]], self_us: dict[str, float]) -> None:
    _end, name, children, dur = stack.pop()
    self_us[name] = self_us.get(name, 0.0) + max(dur - children, 0.0)


def _compute(ops: list[dict[str, Any]]) -> Intervals:
    """When some thread computes: its ``aten::`` operators and kernels, less those inside a
    collective on the same thread (a copy into a collective's buffer is communication, not
    compute that hides it)."""
    threads: dict[Any, list[dict[str, Any]]] = {}
    for e in ops:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    spans: Intervals = []
    for thread in threads.values():
        own = lambda pick: union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in thread if pick(e))  # noqa: E731
        spans += subtract(own(lambda e: not is_comm(e["name"]) and (e["name"].startswith("aten::")
                                                                    or e.get("cat") == "kernel")),
                          own(lambda e: is_comm(e["name"])))
    return union(spans)


def _fewer(segments: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """At most :data:`MAX_SEGMENTS` segments: neighbours of one part merge, then the shortest go."""
    merged: list[tuple[str, float, float]] = []
    for part, start, end in segments:
        if merged and merged[-1][0] == part and start - merged[-1][2] < 1e-3:
            merged[-1] = (part, merged[-1][1], end)
        else:
            merged.append((part, start, end))
    if len(merged) > MAX_SEGMENTS:
        keep = sorted(range(len(merged)), key=lambda i: merged[i][1] - merged[i][2])[:MAX_SEGMENTS]
        merged = [merged[i] for i in sorted(keep)]
    return merged
