"""The torchft lighthouse that replica groups meet at, and its gate: ``python -m scaleloop.launching.lighthouse``.

The lighthouse (torchft's ``LighthouseServer``, at HOST:PORT) forms the quorum of the groups alive
before every step: one group is enough (``min_replicas=1``), so the others go on when one is lost;
a group that still sends heartbeats but has not asked yet is waited for (``JOIN_TIMEOUT_MS``),
and one silent for ``HEARTBEAT_TIMEOUT_MS`` counts as lost.

Its gate (a second ``LighthouseServer`` at PORT+1, ``min_replicas=N``) is passed once, at a fresh
start: each group's rank 0 waits there until all N groups have come, so that their first quorum
holds every group and a run without faults trains as DDP over all of them. A restarted group does
not wait there (``strategies.fault_tolerant``).

On one machine the launcher starts it (:func:`start`), listening on loopback only (``127.0.0.1``:
no other machine has a group to send). Across machines, run it on one of them; it listens on every
interface (``--bind ::``, the default) so that the other machines reach it::

    python -m scaleloop.launching.lighthouse --replica-groups 2 --port 29510

and start each group with ``--lighthouse HOST:29510`` (docs/fault-tolerance.md). This module
imports torchft (and so torch) only in :func:`main`: the launcher that calls :func:`start` imports none.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, Sequence

from scaleloop.errors import UsageError
from scaleloop.launching import lifeline

DEFAULT_PORT = 29510
#: How long a quorum waits for a group that sends heartbeats but has not asked yet (a slower step).
JOIN_TIMEOUT_MS = 60_000
#: A group silent this long is lost: the quorum forms without it.
HEARTBEAT_TIMEOUT_MS = 3_000
#: The gate counts a group that asked as present this long. A group waiting there sends no heartbeat
#: (its request is its only one): with torchft's default (5 s), groups that came more than 5 s apart
#: (another machine's slower start) never all counted at once, and the gate waited out --timeout.
GATE_HEARTBEAT_TIMEOUT_MS = 24 * 3600 * 1000
#: How long the launcher waits for the lighthouse to say where it listens (it imports torch first).
START_TIMEOUT_S = 120.0
#: Where the lighthouse that :func:`start` starts for groups on this machine listens, and how they reach it.
LOOPBACK = "127.0.0.1"
_READY = "lighthouse listening at "


@dataclass
class Lighthouse:
    """A lighthouse this launcher started: its process and ``HOST:PORT``."""

    process: "subprocess.Popen[str]"
    endpoint: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port_pair() -> int:
    """A port P on this machine such that P and P+1 are both free now (the lighthouse and its gate)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("", port + 1))
                except OSError:
                    continue
        return port
    raise OSError("no two adjacent free ports found for the lighthouse")


def start(groups: int, log: Path, python: str = sys.executable) -> Lighthouse:
    """Start the lighthouse and its gate for ``groups`` groups on this machine, its messages in ``log``;
    returns once it listens, on loopback only (:data:`LOOPBACK`): every group runs here. UsageError
    (one line) if it cannot start."""
    port = free_port_pair()
    with open(log, "a", encoding="utf-8") as out:
        process = subprocess.Popen([python, "-m", __name__, "--replica-groups", str(groups), "--port", str(port),
                                    "--bind", LOOPBACK, "--host", LOOPBACK], stdout=subprocess.PIPE, stderr=out,
                                   text=True, env=lifeline.child_env(os.environ))
    assert process.stdout is not None
    line = _first_line(process.stdout, START_TIMEOUT_S)
    if not line.startswith(_READY):
        process.kill()
        process.wait()
        raise UsageError(f"the torchft lighthouse did not start (its messages: {log})")
    return Lighthouse(process, line[len(_READY):].strip())


def _first_line(stream: IO[str], timeout_s: float) -> str:
    """The first line of ``stream``, or "" once ``timeout_s`` has passed or it ended."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return stream.readline()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve the lighthouse and its gate until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m scaleloop.launching.lighthouse", description=__doc__.split("\n")[0])
    parser.add_argument("--replica-groups", type=int, required=True, help="the groups of the job (N)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the lighthouse's port; its gate uses PORT+1")
    parser.add_argument("--host", default=socket.gethostname(), help="the name the groups reach this machine by")
    parser.add_argument("--bind", default="::", metavar="ADDRESS",
                        help="the address it and its gate listen on (default ::, every interface, for groups on other "
                             f"machines; {LOOPBACK} when every group runs on this machine)")
    args = parser.parse_args(argv)
    lifeline.hold()
    stop = [signal.SIGTERM, signal.SIGINT]
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)   # before torchft's threads start: they inherit the mask
    from torchft.coordination import LighthouseServer

    def bind(port: int) -> str:   # torchft's form: "127.0.0.1:29510", "[::]:29510"
        return f"[{args.bind}]:{port}" if ":" in args.bind else f"{args.bind}:{port}"

    servers = [LighthouseServer(bind=bind(args.port), min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS),
               LighthouseServer(bind=bind(args.port + 1), min_replicas=args.replica_groups,
                                heartbeat_timeout_ms=GATE_HEARTBEAT_TIMEOUT_MS)]
    print(f"{_READY}{args.host}:{args.port}", flush=True)
    started = time.time()
    received = signal.sigwait(stop)
    for server in servers:
        server.shutdown()
    print(f"lighthouse stopped by {signal.Signals(received).name} after {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
