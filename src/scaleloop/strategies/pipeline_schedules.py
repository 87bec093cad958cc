"""How a pipeline cuts a micro-step into pieces, and which schedules can run them (no torch here).

Checked with the config (``strategies.registry``) before any worker starts, and used by the
pipeline strategy at every step.
"""
from __future__ import annotations

from scaleloop.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def check_pipeline_schedule(schedule: str, stages: int, microbatches: int, stages_per_rank: int = 0) -> int:
    """Model stages per process for a pipeline ``schedule`` over ``stages`` processes; UsageError
    for a combination that cannot run (1F1B keeps every stage busy only with at least one piece
    per stage, and torch refuses fewer)."""
    if schedule not in SCHEDULES:
        raise UsageError(f"--pipeline-schedule {schedule!r} is not one of: gpipe, 1f1b, interleaved")
    if stages_per_rank not in (0, 1) and schedule != "interleaved":
        raise UsageError(f"--stages-per-rank {stages_per_rank} needs --pipeline-schedule interleaved (gpipe and 1f1b "
                         "run one stage per process)")
    if stages_per_rank == 1 and schedule == "interleaved":
        raise UsageError("--pipeline-schedule interleaved runs several stages per process: use --stages-per-rank 2 "
                         "or more, or --pipeline-schedule 1f1b")
    if schedule == "1f1b" and microbatches < stages:
        raise UsageError(f"--pipeline-schedule 1f1b needs at least one piece per stage: --microbatches {microbatches} "
                         f"is fewer than the {stages} stages; use --microbatches {stages} or more, or gpipe")
    return (stages_per_rank or 2) if schedule == "interleaved" else 1


def pipeline_pieces(n: int, microbatches: int, schedule: str, ranks: int) -> tuple[int, str]:
    """How a micro-step of ``n`` samples runs: ``(pieces, schedule)``, the largest number of equal
    pieces up to ``microbatches`` that the schedule can run on ``ranks`` processes.

    1F1B needs at least ``ranks`` pieces: a smaller micro-step (an epoch's uneven last one) runs
    as GPipe, which computes the same thing in another order. Interleaved 1F1B needs the pieces to
    be a multiple of its rounds (``pieces // ranks``, at least 1).
    """
    m = min(microbatches, n)
    while m > 1 and (n % m or (schedule == "interleaved" and m % max(1, m // ranks))):
        m -= 1
    if schedule == "1f1b" and m < ranks:
        return m, "gpipe"
    return m, schedule
