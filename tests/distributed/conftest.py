"""Shared set-up for the multi-process tests: no process outlives the test that started it."""
from __future__ import annotations

from typing import Iterator

import pytest

from procs import no_process_left


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield
    no_process_left()
