"""``scaleloop.launch``'s forks: its agent a fork of the caller, and its forked workers' first wait.

``scaleloop.launch(fn, nproc=N)`` runs a function of the caller's (a notebook's, a closure) in
its workers, so its elastic agent is a fork of the caller and, with the ``fork`` start method,
its workers are forks of that agent (``scaleloop.launching.spawn``). ``scaleloop train``,
``verify`` and ``bench`` fork nothing: their torchrun and workers are fresh interpreters.

- :func:`start_function` forks the agent: a child that starts as a fresh process would (default
  signal handlers, none of the caller's exit handlers, the caller's objects never collected
  there: their destructors would close what only the caller holds), holds its lifeline to the
  caller and is watched as torchrun is (``scaleloop.launching.supervisor.Workers``).
- :func:`wait_for_siblings`: a forked worker waits, before it touches the network, until the
  agent has forked all its siblings. The agent has threads, among them its store's server,
  which looks up the address of every worker that connects to it (glibc's ``getnameinfo``,
  under the resolver's lock). A worker forked while that thread holds the lock inherits it held,
  with no thread left to release it, and its own first lookup (the store's address, at
  ``init_process_group``) waits forever: seen about once in 60 launches of 4 workers on a 2-core
  machine. A fork taken before any worker has connected cannot inherit it, so each worker waits
  until the agent has as many children as there are workers on this machine. Linux lists a
  process's children in ``/proc/PID/task/TID/children``; elsewhere (or unreadable) no wait.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from scaleloop.launching import lifeline
from scaleloop.launching.supervisor import Workers
from scaleloop.launching.torchrun import WorkerLaunch

#: The longest a worker waits for its siblings; past it, it goes on (a sibling that failed to start).
SIBLINGS_WAIT_S = 30.0


class ForkedAgent:
    """The agent as a fork of this process: the part of ``subprocess.Popen`` that ``Workers`` uses."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args, self.returncode = pid, list(args), None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        # Polled, never a blocking waitpid: see Workers.wait.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_function(run: Callable[[], int], launch: WorkerLaunch) -> Workers:
    """Start an agent that is a function of this process (``scaleloop.launch``'s elastic agent, which
    runs the caller's own Python function in its workers): a fork of this process that holds its
    lifeline to it and returns ``run()``'s value as its exit code, watched as torchrun is. Its
    workers never outlive it, nor it this process."""
    launch.logs.mkdir(parents=True, exist_ok=True)
    env = lifeline.child_env(dict(os.environ if launch.env is None else launch.env))

    def held() -> int:
        lifeline.hold()
        return run()

    return Workers(launch, _fork(held, [launch.module], env), time.time())  # type: ignore[arg-type]


def _fork(run: Callable[[], int], args: Sequence[str], env: dict[str, str]) -> ForkedAgent:
    """``run()`` in a fork of this process with ``env``, its return value the fork's exit code.

    The fork starts as a fresh process would: default signal handlers, none of this process's
    exit handlers, and this process's objects frozen, so that they are never collected there
    (their destructors would close what only this process holds). It collects no garbage of
    its own either, so that its own forks (the workers) find none of the caller's objects
    collected; each worker starts collecting once it has frozen them (``spawn._Worker``)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    collecting = gc.isenabled()
    gc.disable()
    pid = os.fork()
    if pid:
        if collecting:
            gc.enable()
        return ForkedAgent(pid, args)
    code = 1
    try:
        gc.freeze()
        atexit._clear()   # the caller's exit handlers are the caller's: none runs in this fork
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        code = run()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the agent's own failure: as a fresh agent would print it
        traceback.print_exc()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def children_file(parent: int) -> Path:
    """Where Linux lists the children that ``parent``'s main thread forked."""
    return Path(f"/proc/{parent}/task/{parent}/children")


def count_children(listing: Path) -> Optional[int]:
    """How many processes ``listing`` names (None: it cannot be read)."""
    try:
        return len(listing.read_text().split())
    except OSError:
        return None


def wait_for_siblings(environ: Mapping[str, str] = os.environ, parent: Optional[int] = None,
                      listing: Optional[Path] = None, timeout_s: float = SIBLINGS_WAIT_S) -> bool:
    """Wait until the agent (``parent``, default this process's parent) has forked
    ``LOCAL_WORLD_SIZE`` workers. True once it has; False when there is nothing to wait for or
    the count cannot be read, or after ``timeout_s``."""
    local = environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 2:
        return False
    listing = listing or children_file(parent or os.getppid())
    deadline = time.monotonic() + timeout_s
    while True:
        count = count_children(listing)
        if count is None:
            return False
        if count >= int(local):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)   # the agent forks the next worker within milliseconds
