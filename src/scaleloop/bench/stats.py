"""Summaries of repeated measurements: the median, and how far the repetitions spread."""
from __future__ import annotations

import statistics
from typing import Sequence


def summarize(values: Sequence[float]) -> dict[str, float]:
    """median, mean, min, max, quartiles (q1, q3) and the spread ``(max - min) / median`` of ``values``.

    The median, not the mean, is the headline: one repetition slowed by something else on the
    machine moves the mean but not the median.
    """
    if not values:
        raise ValueError("nothing to summarize")
    xs = [float(v) for v in values]
    median = statistics.median(xs)
    # Inclusive quartiles: with few repetitions they stay inside the measured range.
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (median, median, median)
    return {
        "n": len(xs),
        "median": median,
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": q1,
        "q3": q3,
        "spread": (max(xs) - min(xs)) / median if median else 0.0,
    }


def interval_union(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once.

    Gradient buckets are reduced concurrently; the time with *some* communication in flight
    is the union of their intervals, not the sum.
    """
    total = 0.0
    end_so_far = float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total
