"""Shared set-up for the multi-process tests: no process outlives the test that started it."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from procs import kill_owned, owned_pids


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield
    # Processes that are ending on their own get a moment; any still running are the
    # test's leak: end them, and fail the test so the leak is seen.
    deadline = time.monotonic() + 5
    while owned_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = owned_pids()
    kill_owned()
    assert not left, f"the test left processes behind: {left}"
