"""A pipeline's pieces and schedules without torch (``scaleloop.strategies.pipeline_schedules``)."""
from __future__ import annotations

import pytest

from scaleloop.errors import UsageError
from scaleloop.strategies.pipeline_schedules import check_pipeline_schedule, pipeline_pieces


@pytest.mark.parametrize("n, m, schedule, ranks, expected", [
    (32, 4, "gpipe", 2, (4, "gpipe")),
    (30, 4, "gpipe", 2, (3, "gpipe")),          # the largest divisor of 30 up to 4
    (30, 4, "1f1b", 2, (3, "1f1b")),            # 3 pieces still feed 2 stages
    (5, 4, "1f1b", 2, (1, "gpipe")),            # one piece cannot: GPipe, the same computation
    (32, 4, "interleaved", 2, (4, "interleaved")),
    (12, 8, "interleaved", 4, (6, "interleaved")),   # 8 and 7 do not divide 12; 6 is one round of 6
    (10, 8, "interleaved", 4, (5, "interleaved")),
    (3, 8, "gpipe", 2, (3, "gpipe")),           # never more pieces than samples
])
def test_pipeline_pieces(n: int, m: int, schedule: str, ranks: int, expected: tuple[int, str]) -> None:
    pieces, ran = pipeline_pieces(n, m, schedule, ranks)
    assert (pieces, ran) == expected
    assert n % pieces == 0
    if ran == "interleaved":   # torch's rule: the pieces are a multiple of the rounds
        assert pieces % max(1, pieces // ranks) == 0


def test_pipeline_schedule_stages_per_rank_and_refusals() -> None:
    assert check_pipeline_schedule("gpipe", 2, 1) == 1
    assert check_pipeline_schedule("1f1b", 2, 2) == 1
    assert check_pipeline_schedule("interleaved", 2, 1) == 2
    assert check_pipeline_schedule("interleaved", 2, 4, 3) == 3
    with pytest.raises(UsageError, match="--microbatches 2 is fewer than the 4 stages; use --microbatches 4"):
        check_pipeline_schedule("1f1b", 4, 2)
    with pytest.raises(UsageError, match="needs --pipeline-schedule interleaved"):
        check_pipeline_schedule("gpipe", 2, 2, 2)
    with pytest.raises(UsageError, match="--stages-per-rank 2 or more"):
        check_pipeline_schedule("interleaved", 2, 2, 1)
    with pytest.raises(UsageError, match="not one of"):
        check_pipeline_schedule("zero-bubble", 2, 2)
