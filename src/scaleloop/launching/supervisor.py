"""The one way scaleloop starts workers: torchrun (through ``scaleloop.launching.agent``), watched.

Train, verify and bench describe their workers as a ``WorkerLaunch``
(``scaleloop.launching.torchrun``) and start them here:

- :func:`start` starts torchrun (or, for a ``direct`` launch, the one worker) as a fresh
  interpreter, a child of this process that holds its lifeline to it
  (``scaleloop.launching.lifeline``): however this process ends, even by ``kill -9``, torchrun
  and then its workers end with it. ``scaleloop.launch``'s agent, a fork of the caller, is
  started by ``scaleloop.launching.forks`` and watched here alike;
- :func:`supervise` starts, passes this process's stop signals on as SIGUSR1 (the workers then
  finish their step and checkpoint), and waits; while it waits, a worker that is stopped (SIGSTOP)
  when torchrun tells it to end is continued, so that it ends at once
  (:func:`continue_stopped_workers`);
- :class:`LaunchOutcome` is the exit code, and after a failure :meth:`LaunchOutcome.failure` reads the workers'
  error files and logs into the short report (``scaleloop.launching.failures``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Optional, Sequence, Union

from scaleloop.launching import lifeline
from scaleloop.errors import EXIT_INTERRUPTED
from scaleloop.launching.failures import Failure, analyse, exit_codes
from scaleloop.launching.torchrun import WorkerLaunch
from scaleloop.runtime import preempt

# After SIGTERM, how long torchrun gets to stop its workers before it is killed (its workers
# then die with it, see lifeline).
STOP_GRACE_S = 15.0
# After SIGINT here, how long torchrun gets to end on its own before it is sent SIGINT itself.
INTERRUPT_GRACE_S = 5.0
# How often a wait for the workers looks whether they ended (and lets a signal's handler run).
POLL_S = 0.1

# How often a wait looks for a worker that is stopped (SIGSTOP) while told to end.
STOPPED_LOOK_S = 1.0
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)   # in /proc/<pid>/status's pending-signal masks

_Output = Union[None, int, IO[Any]]

# How a process that ended on SIGINT exits: with 130 once it said so itself (the workers, torchrun),
# or killed by the signal (before any handler of its own was set).
INTERRUPTED_CODES = (EXIT_INTERRUPTED, -signal.SIGINT)


@dataclass(frozen=True)
class LaunchOutcome:
    """How a launch ended: torchrun's exit code (0: every worker succeeded; the worker's own for a
    ``direct`` launch; negative: killed by that signal)."""

    launch: WorkerLaunch
    code: int
    started: float          # time.time() at the start, to tell this launch's logs from older ones

    @property
    def ok(self) -> bool:
        return self.code == 0

    def interrupted(self) -> bool:
        """Whether the workers ended on an interrupt, not on a failure: torchrun stopped by SIGINT (exit
        code 130; a ``direct`` worker's own), or the first worker to end did so on SIGINT. Also when
        the SIGINT reached them but not this process (``kill -INT`` on torchrun or a worker, or a
        shell that started this process with SIGINT ignored), which then hears of it only here."""
        if self.code in INTERRUPTED_CODES:
            return True
        if self.code == 0:
            return False
        first = next(iter(exit_codes(self.launch.logs).values()), None)
        return first in INTERRUPTED_CODES

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
        return analyse(run_dir, self.launch.error_dir, ranks, timeout_s, self.code, continue_line, doctor=doctor,
                       machines=self.launch.nnodes)


class Workers:
    """A started launch: torchrun (or the direct worker) as this process's child.

    As a context manager: on leaving with an exception the workers are stopped (:meth:`stop`),
    so none outlives a failed caller.
    """

    def __init__(self, launch: WorkerLaunch, proc: subprocess.Popen, started: float) -> None:
        self.launch, self.proc, self.started = launch, proc, started

    def wait(self, timeout: Optional[float] = None) -> LaunchOutcome:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds).

        It polls rather than blocking in ``waitpid``: a signal sent to this process (``kill -INT``)
        may be delivered to another of its threads, and would then not interrupt a blocked wait
        (the run went on to its end, Ctrl-C unheard); between polls Python runs its handler.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        looked = time.monotonic()
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return LaunchOutcome(self.launch, self.proc.wait(timeout=left), self.started)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.proc.args, timeout or 0.0) from None
            if time.monotonic() - looked >= STOPPED_LOOK_S:
                looked = time.monotonic()
                continue_stopped_workers(self.proc.pid)


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
    launch.logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if launch.env is None else launch.env)
    if launch.direct:
        # Where torchrun would put rank 0's error file, read by the worker's record() and analyse().
        error_file = launch.error_dir / "single" / "attempt_0" / "0" / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    started = time.time()
    env = lifeline.child_env(env)
    proc = subprocess.Popen(launch.supervised_command(), env=env, stdout=stdout,
                            stderr=stderr, text=text, bufsize=1 if text else -1)
    return Workers(launch, proc, started)


def supervise(launch: WorkerLaunch, *, forward: Sequence[signal.Signals] = ()) -> LaunchOutcome:
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


def wait_out(workers: Workers) -> LaunchOutcome:
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


def continue_stopped_workers(agent_pid: int) -> list[int]:
    """Send SIGCONT to each worker of torchrun (``agent_pid``'s children) that is stopped (SIGSTOP, or
    a debugger's Ctrl-Z) while a SIGTERM waits for it; returns their pids (Linux; elsewhere none).

    Why: once a worker failed, torchrun stops the others with SIGTERM and waits 30 s before SIGKILL
    (a wait its API does not let one shorten). A stopped process cannot act on SIGTERM, so a run
    with a frozen rank would end only after that wait. Continued, it acts on it at once: it dumps
    its stack into its log (where it was, for the report) and ends. A stopped worker that nobody
    asked to end is left stopped: whoever stopped it may mean to continue it.
    """
    continued = []
    for pid in _children(agent_pid):
        if _stopped_with_sigterm_pending(pid):
            try:
                os.kill(pid, signal.SIGCONT)
                continued.append(pid)
            except ProcessLookupError:
                pass
    return continued


def _children(pid: int) -> list[int]:
    """``pid``'s child processes, from each of its threads' ``children`` list in /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def _stopped_with_sigterm_pending(pid: int) -> bool:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        status = dict(line.split(":", 1) for line in lines if ":" in line)
    except OSError:
        return False
    if not status.get("State", "").strip().startswith("T"):
        return False
    pending = 0
    for key in ("SigPnd", "ShdPnd"):
        try:
            pending |= int(status.get(key, "0").strip(), 16)
        except ValueError:
            continue
    return bool(pending & _SIGTERM_BIT)
