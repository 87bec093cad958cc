"""scaleloop.launch's forked worker waits until the agent has forked all its siblings (scaleloop.launching.forks):
counted from Linux's list of the agent's children; no wait where there is nothing to count."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from scaleloop.launching.forks import children_file, count_children, wait_for_siblings


def test_it_waits_until_the_parent_has_as_many_children_as_local_workers(tmp_path: Path) -> None:
    listing = tmp_path / "children"
    listing.write_text("101 ")
    waiting = threading.Event()
    result: list[bool] = []

    def worker() -> None:
        waiting.set()
        result.append(wait_for_siblings({"LOCAL_WORLD_SIZE": "3"}, listing=listing, timeout_s=60))

    thread = threading.Thread(target=worker)
    thread.start()
    waiting.wait(10)
    assert not result                       # one child of three: still waiting
    listing.write_text("101 102 103 ")
    thread.join(60)
    assert result == [True]


@pytest.mark.parametrize("environ", [{}, {"LOCAL_WORLD_SIZE": "1"}, {"LOCAL_WORLD_SIZE": "x"}])
def test_no_wait_for_one_worker_or_none(tmp_path: Path, environ: dict) -> None:
    assert wait_for_siblings(environ, listing=tmp_path / "never-read") is False


def test_an_unreadable_list_is_no_wait_and_a_short_one_ends_at_the_timeout(tmp_path: Path) -> None:
    assert count_children(tmp_path / "missing") is None
    assert wait_for_siblings({"LOCAL_WORLD_SIZE": "2"}, listing=tmp_path / "missing") is False
    short = tmp_path / "children"
    short.write_text("7 ")
    assert wait_for_siblings({"LOCAL_WORLD_SIZE": "2"}, listing=short, timeout_s=0.0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux lists a process's children in /proc")
def test_linux_lists_this_processs_children() -> None:
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
                for _ in range(2)]
    try:
        listed = count_children(children_file(os.getpid()))
        assert listed is not None and listed >= 2
        assert wait_for_siblings({"LOCAL_WORLD_SIZE": "2"}, parent=os.getpid(), timeout_s=10) is True
    finally:
        for child in children:
            child.stdin.close()   # type: ignore[union-attr]
            child.wait(30)
