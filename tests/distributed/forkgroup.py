"""Several runs at once, each as the tests' fork server runs one: ``python forkgroup.py SPEC.json``.

The fork server (``forkserver.py``) runs one request at a time, but the machines of one job (a
Kubeflow job's pods, a SLURM job's tasks, the launchers of ``--nnodes 2``) must all be running
for any of them to get past the rendezvous. Started as one request of the server, this script
forks every run of ``SPEC`` (a JSON object: ``runs``, a list of the server's requests, each with
an optional ``delay`` in seconds; ``codes``, the file that gets their exit codes) and turns each
fork into its run exactly as the server does (``forkserver._child``): this process, like the
server, has only imported modules, so its forks are as clean as the server's. It ends once every
run has ended.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import forkserver


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    pids = []
    started = time.monotonic()
    for request in spec["runs"]:
        # A later start (the second pod of a job) is part of what some runs check.
        time.sleep(max(0.0, float(request.get("delay", 0)) - (time.monotonic() - started)))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            forkserver._child(request)   # never returns
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    Path(spec["codes"]).write_text(json.dumps(codes), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
