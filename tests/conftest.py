"""Test order: the files that start many processes first.

`make test` runs the suite on three pytest workers, each taking one whole file at a time (so a
file's shared runs, its module-scoped fixtures, are made once). The workers take files in
collection order; a long file taken last would leave the other workers idle at the end, so the
longest files (measured) are collected first, then the other multi-process files. The order inside
a file is kept.
"""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent

# The longest files, longest first (seconds of one fresh-clone suite run, 2026-12-06, 2 cores):
# a long file started late is the whole suite's tail.
LONGEST = ("distributed/test_elastic_nodes.py",         # 150
           "distributed/test_async_checkpoint_dist.py",  # 130
           "distributed/test_users_launch.py",           # 113
           "distributed/test_doc_commands_dist.py",      # 95
           "distributed/test_ray.py",                    # 91
           "distributed/test_usermodels.py",             # 90
           "distributed/test_failures_dist.py",          # 78
           "distributed/test_loader_and_interrupts_dist.py",  # 73
           "test_docs.py",                               # 66
           "distributed/test_stall_timeout_dist.py",     # 58
           "distributed/test_matrix.py",                 # 55
           "bench/test_bench_overhead_modes.py",         # 53
           "distributed/test_bench.py",                  # 49
           "distributed/test_elastic.py",                # 49
           "distributed/test_thirdparty_models.py",      # 48
           "checkpoint/test_killed_resume.py",           # 45
           "test_docs_language_models.py")               # 44

# Then the folders whose files start real process groups or whole `scaleloop` runs.
FIRST = ("distributed", "bench", "commands", "launching")


def _rank(item: pytest.Item) -> int:
    path = Path(str(item.path)).resolve().relative_to(HERE)
    if path.as_posix() in LONGEST:
        return LONGEST.index(path.as_posix())
    parts = path.parts
    return len(LONGEST) + (FIRST.index(parts[0]) if len(parts) > 1 and parts[0] in FIRST else len(FIRST))


def pytest_configure(config: pytest.Config) -> None:
    """Hear Ctrl-C as a terminal's foreground job does, however the suite was started.

    A shell without job control starts a background command (``pytest ... &``, as a script or
    ``nohup`` does) with SIGINT ignored, and every process it starts inherits that: the tests that
    interrupt a run (``kill -INT``) would then see it go on to its end. A handler set here is
    reset to the default in each process these tests start, as a terminal's would be.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each file's tests stay together and in their order


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB file system of its own (tmpfs), for runs that fill their disk; grow it with
    ``mount -o remount,size=...``. Skipped where mounting is not permitted (not root, a container
    without the capability)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, check=False)
