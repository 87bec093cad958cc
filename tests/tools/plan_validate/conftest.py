"""What the plan check's tests share: a time limit for the ones that launch real process groups."""
from __future__ import annotations

import signal
from typing import Any, Iterator

import pytest

TIME_LIMIT_S = 180


@pytest.fixture
def time_limit() -> Iterator[None]:
    """Fail the test (and so stop its workers: the launcher does on any exception) after
    ``TIME_LIMIT_S`` seconds."""
    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test ran over {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
