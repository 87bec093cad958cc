"""What a single-machine run listens on (issue 51.3), as docs/troubleshooting.md's security section
says: torch's two stores on every interface (``::``, torch binds no narrower), Gloo on loopback.

The run is held at a known point by ``slow_models:held`` (rank 0 waits at its 8th training forward
for a file the test creates) while the test reads /proc. Should torch one day bind the stores to
loopback, this test fails, and the page (and this test) should say the better news.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from listening import descendants, listening
from procs import SRC, ForkedRun, child_env, kill_group

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_single_machine_run_listens_where_the_security_section_says(tmp_path: Path) -> None:
    env = child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]),
                     "HOLD_REACHED": str(tmp_path / "reached"), "HOLD_RELEASE": str(tmp_path / "release")})
    # A fork of the tests' fork server, as are the agent and workers it starts (forked_launch.py): the
    # sockets are torch's and Gloo's, bound as in a fresh process.
    proc = ForkedRun([sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--no-progress",
                      "--no-tensorboard", "--model", "slow_models:held", "--max-steps", "10",
                      "--out", str(tmp_path / "run")], cwd=SCRIPTS, env=env, timeout=240)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "reached").exists():   # the file the held rank writes
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before it was held: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "the run was not held within 240 s"
            time.sleep(0.02)
        bound = listening(descendants(proc.pid))
        (tmp_path / "release").touch()
        _, err = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err
    # The rendezvous store and the process group's store: every interface ("::", or "0.0.0.0" on a
    # machine without IPv6); Gloo: loopback only. Nothing else.
    wildcard = [port for address, port in bound if address in ("::", "0.0.0.0")]
    loopback = [port for address, port in bound if address == "127.0.0.1"]
    assert len(set(wildcard)) == 2 and loopback and len(wildcard) + len(loopback) == len(bound), sorted(bound)
