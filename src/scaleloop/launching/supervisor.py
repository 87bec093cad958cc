"""The one way scaleloop starts workers: torchrun (through ``scaleloop.launching.agent``), watched.

Train, verify and bench describe their workers as a ``WorkerLaunch``
(``scaleloop.launching.torchrun``) and start them here:

- :func:`start` starts torchrun (or, for a ``direct`` launch, the one worker) as a child of
  this process that holds its lifeline to it (``scaleloop.launching.lifeline``): however this
  process ends, even by ``kill -9``, torchrun and then its workers end with it. Where the agent
  forks its workers (no GPU, see ``scaleloop.launching.agent``) and torch is imported here
  already, torchrun is a fork of this process too, which spares it importing torch again;
  either way it runs ``scaleloop.launching.agent``'s ``main`` with the same arguments;
- :func:`supervise` starts, passes this process's stop signals on as SIGUSR1 (the workers then
  finish their step and checkpoint), and waits;
- :class:`Ended` is the exit code, and after a failure :meth:`Ended.failure` reads the workers'
  error files and logs into the short report (``scaleloop.launching.failures``).
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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Callable, Optional, Sequence, Union

from scaleloop.launching import lifeline
from scaleloop.launching.failures import Failure, analyse
from scaleloop.launching.torchrun import WorkerLaunch
from scaleloop.runtime import preempt

# After SIGTERM, how long torchrun gets to stop its workers before it is killed (its workers
# then die with it, see lifeline).
STOP_GRACE_S = 15.0
# After SIGINT here, how long torchrun gets to end on its own before it is sent SIGINT itself.
INTERRUPT_GRACE_S = 5.0
# How often a wait for the workers looks whether they ended (and lets a signal's handler run).
POLL_S = 0.1

_Output = Union[None, int, IO[Any]]


@dataclass(frozen=True)
class Ended:
    """How a launch ended: torchrun's exit code (0: every worker succeeded; the worker's own for a
    ``direct`` launch; negative: killed by that signal)."""

    launch: WorkerLaunch
    code: int
    started: float          # time.time() at the start, to tell this launch's logs from older ones

    @property
    def ok(self) -> bool:
        return self.code == 0

    def ranks_logged(self) -> list[int]:
        """The ranks of this machine that wrote their log in this launch."""
        ranks = []
        for path in self.launch.logs.glob("rank-*.log"):
            try:
                if path.stat().st_mtime >= self.started - 1:
                    ranks.append(int(path.stem.partition("-")[2]))
            except (OSError, ValueError):
                continue
        return sorted(ranks)

    def failure(self, run_dir: Path, *, continue_line: Optional[str], timeout_s: Optional[float] = None,
                ranks: Optional[Sequence[int]] = None, doctor: bool = True) -> Failure:
        """Which rank failed first (or stalled) and where, from the workers' error files and logs in
        ``run_dir`` (see ``scaleloop.launching.failures.analyse``); ``ranks`` default to those that
        logged in this launch. Not written: ``Failure.write`` puts it in ``failure.json``."""
        ranks = self.ranks_logged() if ranks is None else list(ranks)
        return analyse(run_dir, self.launch.error_dir, ranks, timeout_s, self.code, continue_line, doctor=doctor)


class Workers:
    """A started launch: torchrun (or the direct worker) as this process's child.

    As a context manager: on leaving with an exception the workers are stopped (:meth:`stop`),
    so none outlives a failed caller.
    """

    def __init__(self, launch: WorkerLaunch, proc: subprocess.Popen, started: float) -> None:
        self.launch, self.proc, self.started = launch, proc, started

    def wait(self, timeout: Optional[float] = None) -> Ended:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds).

        It polls rather than blocking in ``waitpid``: a signal sent to this process (``kill -INT``)
        may be delivered to another of its threads, and would then not interrupt a blocked wait
        (the run went on to its end, Ctrl-C unheard); between polls Python runs its handler.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return Ended(self.launch, self.proc.wait(timeout=left), self.started)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.proc.args, timeout or 0.0) from None

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to torchrun, which passes it on to its workers; nothing once it has ended."""
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM lets torchrun stop its workers; SIGKILL after ``grace_s`` (the workers follow it)."""
        if self.proc.poll() is not None:
            return
        self.send(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if exc_type is not None:
            self.stop()


def start(launch: WorkerLaunch, *, stdout: _Output = None, stderr: _Output = None, text: bool = False) -> Workers:
    """Start ``launch``'s supervised command; its output goes to ``stdout``/``stderr`` (default: this
    process's console). Same process group as this one: Ctrl-C in a terminal reaches torchrun too."""
    from scaleloop.launching.agent import forks_workers_here

    launch.logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if launch.env is None else launch.env)
    if launch.direct:
        # Where torchrun would put rank 0's error file, read by the worker's record() and analyse().
        error_file = launch.error_dir / "single" / "attempt_0" / "0" / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    started = time.time()
    env = lifeline.child_env(env)
    if not launch.direct and stdout is None and stderr is None and "torch" in sys.modules and forks_workers_here(env):
        return Workers(launch, _fork_agent(launch.agent_args(), env), started)  # type: ignore[arg-type]
    proc = subprocess.Popen(launch.supervised_command(), env=env, stdout=stdout,
                            stderr=stderr, text=text, bufsize=1 if text else -1)
    return Workers(launch, proc, started)


class _ForkedAgent:
    """torchrun as a fork of this process: the part of ``subprocess.Popen`` that ``Workers`` uses."""

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


def _fork_agent(args: Sequence[str], env: dict[str, str]) -> _ForkedAgent:
    """Run ``scaleloop.launching.agent``'s ``main(args)`` in a fork of this process with ``env``,
    started as ``python -m scaleloop.launching.agent ARGS`` would be (handlers, exit handlers and
    this process's objects are not its own: none runs or is collected there)."""
    def run() -> int:
        from scaleloop.launching import agent

        sys.argv = [agent.__file__, *args]
        return agent.main(list(args))

    return _fork(run, args, env, collect=True)


def _fork(run: Callable[[], int], args: Sequence[str], env: dict[str, str], *, collect: bool) -> _ForkedAgent:
    """``run()`` in a fork of this process with ``env``, its return value the fork's exit code.

    The fork starts as a fresh process would: default signal handlers, none of this process's
    exit handlers, and this process's objects frozen, so that they are never collected there
    (their destructors would close what only this process holds). ``collect``: whether the fork
    collects its own garbage (False: its own forks must not collect it either)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    collecting = gc.isenabled()
    gc.disable()
    pid = os.fork()
    if pid:
        if collecting:
            gc.enable()
        return _ForkedAgent(pid, args)
    code = 1
    try:
        gc.freeze()
        if collect:
            gc.enable()
        atexit._clear()
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

    return Workers(launch, _fork(held, [launch.module], env, collect=False), time.time())  # type: ignore[arg-type]


def supervise(launch: WorkerLaunch, *, forward: Sequence[signal.Signals] = ()) -> Ended:
    """Start ``launch`` on this console and wait for it.

    The signals in ``forward`` (a scheduler's or the user's stop request) are not this process's
    end: torchrun passes them on as SIGUSR1, the workers finish their step and checkpoint, and
    the run ends; ``scaleloop.runtime.preempt.requested()`` then says which came. Ctrl-C reaches
    torchrun from the terminal: it stops its workers, and KeyboardInterrupt is raised here after.
    """
    workers = start(launch)
    if forward:
        preempt.listen(list(forward), on_signal=lambda _sig: workers.send(signal.SIGUSR1))
    return wait_out(workers)


def wait_out(workers: Workers) -> Ended:
    """Wait for ``workers`` to end. Ctrl-C here: they are stopped, and KeyboardInterrupt raised after;
    any other exception here (a timeout): they are stopped first."""
    try:
        return workers.wait()
    except KeyboardInterrupt:
        # Ctrl-C in a terminal (or a signal to the whole process group) reached torchrun too, and
        # it is stopping its workers; `kill -INT <this pid>` reached only this process. torchrun
        # that is still running after a while did not hear it: it is told (told twice, it would
        # cut its own orderly stop short).
        try:
            workers.proc.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            workers.send(signal.SIGINT)
        workers.wait()
        raise
    except BaseException:
        workers.stop()
        raise
