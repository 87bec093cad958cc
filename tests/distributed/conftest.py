"""Shared set-up for the multi-process tests: no process outlives the test that started it; a
second fork server for the tests that run two commands at once."""
from __future__ import annotations

from typing import Iterator

import pytest

from procs import ForkServer, no_process_left


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield
    no_process_left()


@pytest.fixture
def second_server() -> Iterator[ForkServer]:
    """A fork server of its own for a second command that runs beside the first (another machine, a
    second replica group): each server runs one command at a time. Forks, not fresh interpreters:
    such a run costs a few CPU-seconds, not tens."""
    server = ForkServer()
    try:
        yield server
    finally:
        if server.proc is not None:   # idle now: no run of its own is left to end
            server.proc.kill()
            server.proc.wait(timeout=60)
