"""The suite's processes: the threads' waiting policy, and the test order.

OpenMP threads wait by sleeping, not spinning. The suite runs three pytest workers and the runs
they start on a 2-core machine: far more busy threads than cores. An idle OpenMP thread of torch's
(a thread of an intra-op pool between two parallel regions) spins for a while before it sleeps,
and there it takes a core from a process that has work. Measured on that machine
(tests/loop/test_training.py and tests/checkpoint/test_resume.py, beside other work): 37.5
CPU-seconds with the default policy, 23.0 with ``OMP_WAIT_POLICY=PASSIVE``. The thread count is
unchanged, so every result is the same; only the waiting differs. Set before torch is imported
(OpenMP reads it when its library loads), and inherited by every process the tests start; a
value already in the environment is kept.

Test order: the files that start many processes first.

`make test` runs the suite on three pytest workers, each taking one whole file at a time (so a
file's shared runs, its module-scoped fixtures, are made once). The workers take files in
collection order; a long file taken last would leave the other workers idle at the end, so the
multi-process files, the longest, are collected first. The order inside a file is kept.
"""
from __future__ import annotations

import fnmatch
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent

# Folders whose files start real process groups or whole `scaleloop` runs, longest first.
FIRST = ("distributed", "bench", "commands", "launching")


def _rank(item: pytest.Item) -> int:
    parts = Path(str(item.path)).resolve().relative_to(HERE).parts
    return FIRST.index(parts[0]) if len(parts) > 1 and parts[0] in FIRST else len(FIRST)


def pytest_configure(config: pytest.Config) -> None:
    """Hear Ctrl-C as a terminal's foreground job does, however the suite was started.

    A shell without job control starts a background command (``pytest ... &``, as a script or
    ``nohup`` does) with SIGINT ignored, and every process it starts inherits that: the tests that
    interrupt a run (``kill -INT``) would then see it go on to its end. A handler set here is
    reset to the default in each process these tests start, as a terminal's would be.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _rewrite_test_modules_once(config)


def _rewrite_test_modules_once(config: pytest.Config) -> None:
    """In the controller of ``pytest -n N``, before its workers start: each test module's
    assertions rewritten once, into pytest's cached copy (``__pycache__/*-pytest-*.pyc``).

    Each worker collects every test module, and pytest rewrites a module's asserts as it imports
    it (a few CPU-seconds for the suite) unless its cached copy is there and up to date (by the
    source's hash). Where PYTHONDONTWRITEBYTECODE is set (as on the test machines), pytest writes
    no cached copy, so every worker rewrote the whole suite: measured on the 2-core machine, a
    worker's collection took 11.9 CPU-seconds, 6.9 with the cached copies. The copies are the
    code pytest itself makes and checks (its own functions, as ``compileall`` compiles the other
    modules at install: see the Makefile); a copy that cannot be made is left to the workers.
    """
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        patterns = list(config.getini("python_files")) + ["conftest.py"]
        if getattr(config.option, "assertmode", "rewrite") != "rewrite":
            return
        roots = {Path(str(arg).split("::")[0]).resolve() for arg in config.args} or {HERE}
        paths = sorted({p for root in roots for p in ([root] if root.is_file() else root.rglob("*.py"))
                        if any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)})
        for path in paths:
            pyc = rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(path, pyc) is None and rewrite.try_makedirs(pyc.parent):
                source_hash, code = rewrite._rewrite_test(path, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except Exception:   # another pytest's internals, a file that does not parse: the workers rewrite as before
        return


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
