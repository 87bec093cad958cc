"""Test order: the files that start many processes first.

`make test` runs the suite on two pytest workers, each taking one whole file at a time (so a
file's shared runs, its module-scoped fixtures, are made once). The workers take files in
collection order; a long file taken last would leave the other worker idle at the end, so the
multi-process files, the longest, are collected first. The order inside a file is kept.
"""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# Folders whose files start real process groups or whole `scaleloop` runs, longest first.
FIRST = ("distributed", "bench", "commands", "launching")


def _rank(item: pytest.Item) -> int:
    parts = Path(str(item.path)).resolve().relative_to(HERE).parts
    return FIRST.index(parts[0]) if len(parts) > 1 and parts[0] in FIRST else len(FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each file's tests stay together and in their order
