"""docs/language-models.md is runnable, as tests/test_docs.py runs the tutorial: every block in
order, in one empty scratch directory, its shown output checked (the rules are test_docs.py's).

It has a file of its own so that the test workers run it beside test_docs.py's two pages.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from procs import kill_owned, owned_pids  # noqa: E402
from test_docs import ROOT, Block, Session, inventory_problems, parse_blocks  # noqa: E402

LANGUAGE_MODELS = ROOT / "docs" / "language-models.md"
BLOCKS = parse_blocks(LANGUAGE_MODELS)


def test_every_block_is_executed_or_checked() -> None:
    assert inventory_problems(BLOCKS) == []
    assert {"python", "console", "text"} <= {b.kind for b in BLOCKS}


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Session:
    return Session(BLOCKS, tmp_path_factory.mktemp("language-models"))


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while owned_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = owned_pids()
    kill_owned()
    assert not left, f"the test left processes behind: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.label.replace(" ", "-") for b in BLOCKS])
def test_language_models_block(page: Session, index: int) -> None:
    page.run_through(index)
    failure, _ = page.results[index]
    if failure is not None:
        pytest.fail(failure, pytrace=False)
