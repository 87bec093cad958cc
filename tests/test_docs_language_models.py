"""docs/language-models.md is runnable, as tests/test_docs.py runs the tutorial: every block in
order, in one empty scratch directory, its shown output checked (the rules are test_docs.py's).

It has a file of its own so that the test workers run it beside test_docs.py's two pages.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
# no_process_left_behind: test_docs.py's autouse fixture, in force here too once imported.
from test_docs import ROOT, Session, inventory_problems, no_process_left_behind, parse_blocks  # noqa: E402,F401

LANGUAGE_MODELS = ROOT / "docs" / "language-models.md"
BLOCKS = parse_blocks(LANGUAGE_MODELS)


def test_every_block_is_executed_or_checked() -> None:
    assert inventory_problems(BLOCKS) == []
    assert {"python", "console", "text"} <= {b.kind for b in BLOCKS}


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Session:
    return Session(BLOCKS, tmp_path_factory.mktemp("language-models"))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.label.replace(" ", "-") for b in BLOCKS])
def test_language_models_block(page: Session, index: int) -> None:
    page.check_block(index)
