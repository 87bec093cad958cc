"""exit_process ends a process as ``sys.exit`` would, in what a program can see: the exit code,
the exit handlers, an unclosed file flushed, and the finalizer of garbage already in a cycle."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path
    from scaleloop.runtime.exiting import exit_process

    folder = Path(sys.argv[1])

    class Cycle:
        def __del__(self):
            (folder / "finalized.txt").write_text("the finalizer ran")

    cycle = Cycle()
    cycle.me = cycle   # unreachable once deleted: only the collector frees it
    del cycle
    log = open(folder / "unclosed.txt", "w")   # never closed: flushed as the module is cleared
    log.write("written, never closed")
    atexit.register(lambda: (folder / "atexit.txt").write_text("atexit ran"))
    exit_process(3)
""")


@pytest.mark.parametrize("ending", ["exit_process", "sys.exit"])
def test_exit_keeps_the_code_handlers_files_and_finalizers(tmp_path: Path, ending: str) -> None:
    script = SCRIPT if ending == "exit_process" else SCRIPT.replace("exit_process(3)", "sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
    assert (tmp_path / "unclosed.txt").read_text() == "written, never closed"
    assert (tmp_path / "finalized.txt").read_text() == "the finalizer ran"
