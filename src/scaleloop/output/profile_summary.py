"""The profile's summary: every rank's numbers in ``<run>/profile/summary.json``, the slowest
rank and why, and the short table the run prints and ``scaleloop doctor``/``plot`` print again
(no torch: the doctor reads it anywhere).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from scaleloop.output.profile_trace import PARTS

PROFILE_DIR = "profile"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.png"
#: A rank this much slower than the others' mean is called a straggler.
STRAGGLER_PCT = 5.0
#: A part over this share of the step is a finding worth a hint.
FINDING_SHARE = 0.2

_HINTS = {
    "comm exposed": "exposed communication: overlap it (ddp overlaps by bucket; fsdp prefetches), fewer "
                    "syncs with --accumulate K, or a faster link",
    "data wait": "data wait: more loader workers (--num-workers), --data-on-device, or a streamed dataset",
    "optimizer": "optimizer: --fused-optimizer, or shard its state (--strategy fsdp)",
}


def trace_name(rank: int) -> str:
    """Rank ``rank``'s trace file: Perfetto opens it, TensorBoard's profiler plugin finds it
    (``*.pt.trace.json`` under ``--logdir``)."""
    return f"rank-{rank}.pt.trace.json"


def combine(ranks: list[dict[str, Any]], **about: Any) -> dict[str, Any]:
    """The summary of every rank's numbers (``profile_trace.analyse``, in rank order) and ``about``
    the run (strategy, device, first profiled step, ...)."""
    for rank, numbers in enumerate(ranks):
        numbers["rank"] = rank
        numbers["trace"] = trace_name(rank)
    return {"version": 1, **about, "world_size": len(ranks), "ranks": ranks,
            "slowest": slowest(ranks), "findings": findings(ranks)}


def slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Which rank's steps were longest, by how much against the others' mean, and the part that
    grew most (its extra time)."""
    slow = max(ranks, key=lambda r: r["step_ms"])
    if len(ranks) == 1:
        return {"rank": 0, "longer_pct": 0.0, "why": None, "text": "one rank: no other to compare with"}
    others = [r for r in ranks if r is not slow]
    mean = sum(r["step_ms"] for r in others) / len(others)
    pct = (slow["step_ms"] / mean - 1) * 100 if mean > 0 else 0.0
    extra = {p: slow["parts_ms"][p] - sum(r["parts_ms"][p] for r in others) / len(others) for p in PARTS}
    why = max(extra, key=lambda p: extra[p])
    what = (f"rank {slow['rank']}: {pct:.0f}% longer steps than the others' mean, its extra time is "
            f"{why} (+{extra[why]:.2f} ms a step)")
    if pct < STRAGGLER_PCT:
        what = f"no straggler: rank {slow['rank']} the slowest, {pct:.1f}% longer steps than the others' mean"
    return {"rank": slow["rank"], "longer_pct": pct, "why": why, "extra_ms": extra[why], "text": what}


def findings(ranks: list[dict[str, Any]]) -> list[str]:
    """A hint for each part that takes over :data:`FINDING_SHARE` of some rank's step."""
    out = []
    for part, hint in _HINTS.items():
        worst = max(ranks, key=lambda r: r["parts_ms"][part] / max(r["step_ms"], 1e-9))
        share = worst["parts_ms"][part] / max(worst["step_ms"], 1e-9)
        if share > FINDING_SHARE:
            out.append(f"{share:.0%} of rank {worst['rank']}'s step is {hint} (docs/profiling.md)")
    return out


def write(profile_dir: Path, summary: dict[str, Any]) -> Path:
    """``summary.json`` in ``profile_dir``; returns its path."""
    path = profile_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return path


def read(run_dir: Path) -> Optional[dict[str, Any]]:
    """A run directory's profile summary, or None when it has none (or an unreadable one)."""
    path = Path(run_dir) / PROFILE_DIR / SUMMARY_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def lines(summary: dict[str, Any], profile_dir: Optional[Path] = None) -> list[str]:
    """The summary as printed: a row per rank (ms per step), its top operators, the slowest rank."""
    first = summary.get("first_step")
    steps = summary["ranks"][0]["steps"]
    where = (f"step {first}" if steps == 1 else f"steps {first}-{first + steps - 1}") if isinstance(first, int) \
        else f"{steps} steps"
    out = [f"profile: {steps} step(s) ({where}) on {summary['world_size']} rank(s), ms per step"
           + (f"; traces in {profile_dir}" if profile_dir is not None else "")]
    heads = ["rank", "step"] + [p for p in PARTS] + ["comm overlapped"]
    out.append("  " + "  ".join(f"{h:>{max(len(h), 6)}}" for h in heads))
    for r in summary["ranks"]:
        cells = [str(r["rank"]), f"{r['step_ms']:.2f}"] + [f"{r['parts_ms'][p]:.2f}" for p in PARTS]
        cells.append(f"{r['comm_overlapped_ms']:.2f}")
        out.append("  " + "  ".join(f"{c:>{max(len(h), 6)}}" for c, h in zip(cells, heads)))
    for r in summary["ranks"]:
        ops = ", ".join(f"{o['name']} {o['self_ms']:.2f}" for o in r["top_ops"][:3])
        out.append(f"  top operators, rank {r['rank']} (self ms per step): {ops}")
    out.append(f"  slowest: {summary['slowest']['text']}")
    out += [f"  finding: {f}" for f in summary.get("findings", [])]
    if summary.get("timeline"):
        out.append(f"  timeline: {summary['timeline']}")
    return out
