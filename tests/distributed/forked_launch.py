"""In a child of the fork server: scaleloop's torchrun agent and its workers as forks, not fresh interpreters.

``scaleloop train --nproc N`` (and ``verify``, ``bench``) starts ``python -m
scaleloop.launching.agent ...`` with ``subprocess.Popen`` (``scaleloop.launching.supervisor.start``),
and torchrun's agent starts each worker as ``python -u -m scaleloop.launching.worker ...``. On the
test machine a fresh agent takes about 1.6 CPU-seconds of start-up and a fresh worker 3.5 (its
``import torch`` and ``torch._dynamo``): most of what a short two-process test costs, and the
suite starts a few hundred of them. :func:`install`, called in a fork server's child (which has
imported torch once, in the server), makes both forks:

- **the agent** (and a replica group's launcher, which starts its own; and the one worker that
  ``scaleloop bench`` starts without torchrun for its 1-worker measurements, ``python -m
  scaleloop.launching.worker ...``): a ``Popen`` whose child is a fork of the launcher that runs the same command in
  place of ``exec``: the pipes, environment, working directory, session and signal dispositions
  that ``Popen`` and ``exec`` would give it, and none of the launcher's exit handlers. The
  launcher sees a real child: its pid, its exit status, its signals and its lifeline are real.
- **the workers**: torchrun's own parser and elastic agent, with ``start_method="fork"`` and an
  entry point that runs the worker's ``-m MODULE ARGS`` as the fresh worker would start: in a
  session of its own (as torchrun starts its subprocesses), default signal handlers, its output
  on the inherited descriptors. Each waits for its siblings to be forked before it runs
  (``scaleloop.launching.forks.wait_for_siblings``: the agent's store thread holds glibc's
  resolver lock while a worker connects, and a fork taken then would inherit it held).

What is not the users' path: the launcher's other descriptors stay open in the agent (``exec``
would close them), the workers are forks, and a worker killed by a signal reaches the agent as
multiprocessing reports it (without the signal's name), and torch's rendezvous names its events
without ``inspect.stack()`` (:func:`_name_rendezvous_events_cheaply`). So a test of the launch itself, a test of
how a dying worker is reported, and at least one
test of each strategy and each launcher, runs fresh: ``procs.run(..., fresh=True)``, or
``SCALELOOP_TEST_FORK_LAUNCH=0`` in the run's environment. ``SCALELOOP_TEST_FRESH=1`` makes
every run of the suite fresh.
"""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import traceback
from typing import Any, Callable

#: In a run's environment, "0": its launches start fresh interpreters, as for users.
FORK_LAUNCH_VAR = "SCALELOOP_TEST_FORK_LAUNCH"
AGENT_MODULE = "scaleloop.launching.agent"
GROUP_LAUNCHER_MODULE = "scaleloop.launching.replica_groups"
# The worker of a launch without torchrun (``WorkerLaunch.direct``: bench's 1-worker runs); torchrun's
# own start it as ``python -u -m ...``, and its agent forks those itself (``forked_torchrun``).
WORKER_MODULE = "scaleloop.launching.worker"


def forks_launches(env: dict[str, str]) -> bool:
    """Whether a run with ``env`` forks its launches."""
    return env.get(FORK_LAUNCH_VAR) != "0"


def is_agent_command(args: Any) -> bool:
    """Whether ``args`` is ``python -m scaleloop.launching.agent ...`` of this Python."""
    return _is_module_command(args, AGENT_MODULE)


def is_forked_command(args: Any) -> bool:
    """Whether a ``Popen`` of ``args`` is forked: the agent, a replica group's launcher (``--replica-groups
    N`` on one machine starts one a group; each then starts its agent, forked too), or the one
    worker of a launch without torchrun (``scaleloop bench``'s 1-worker runs)."""
    return (is_agent_command(args) or _is_module_command(args, GROUP_LAUNCHER_MODULE)
            or _is_module_command(args, WORKER_MODULE))


def _is_module_command(args: Any, module: str) -> bool:
    return (isinstance(args, (list, tuple)) and len(args) >= 3 and args[0] == sys.executable
            and args[1] == "-m" and args[2] == module)


def install(start_child: Callable[[list[str], str], None]) -> None:
    """From here on, this process's ``subprocess.Popen`` of the agent forks it instead.

    ``start_child(argv, cwd)`` turns the fork into the process ``argv`` stands for and never
    returns (the fork server's own start of a run: ``forkserver._become``)."""
    subprocess.Popen = _popen_class(start_child)  # type: ignore[misc]


def _popen_class(start_child: Callable[[list[str], str], None]) -> type:
    class ForkedAgentPopen(subprocess.Popen):  # type: ignore[type-arg]
        """``Popen`` that forks ``python -m scaleloop.launching.agent`` instead of executing it."""

        def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                           cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any,
                           p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                           *rest: Any) -> None:
            # rest: restore_signals, gid, gids, uid, umask, start_new_session (and process_group from 3.11)
            _, gid, gids, uid, umask, start_new_session, *group = rest
            process_group = group[0] if group else -1
            plain = (preexec_fn is None and not shell and executable is None and gid is None and not gids
                     and uid is None)
            if not (plain and is_forked_command(args)):
                return super()._execute_child(  # type: ignore[misc]
                    args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                    shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            collecting = gc.isenabled()
            gc.disable()   # the fork's copies of this process's objects are never collected there
            pid = os.fork()
            if pid == 0:   # never back into the caller's code: a failure here ends the fork
                try:
                    _child_descriptors(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                    if start_new_session:
                        os.setsid()
                    elif process_group is not None and process_group >= 0:
                        os.setpgid(0, process_group)
                    if umask >= 0:
                        os.umask(umask)
                    _exec_signals()
                    if env is not None:
                        os.environ.clear()
                        os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
                    start_child([str(a) for a in args], os.path.abspath(cwd) if cwd else os.getcwd())
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(1)   # start_child never returns
            if collecting:
                gc.enable()
            self.pid = pid
            self._child_created = True
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    return ForkedAgentPopen


def _child_descriptors(p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int) -> None:
    """Standard input, output and error as ``Popen``'s child sets them before ``exec``."""
    for parent_end in (p2cwrite, c2pread, errread):
        if parent_end != -1:
            os.close(parent_end)
    # A descriptor about to be replaced must not be the source of a later one (as _posixsubprocess does).
    if c2pwrite == 0:
        c2pwrite = os.dup(c2pwrite)
    while errwrite in (0, 1):
        errwrite = os.dup(errwrite)
    for source, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
        if source != -1 and source != target:
            os.dup2(source, target)
    for source in {p2cread, c2pwrite, errwrite} - {-1, 0, 1, 2}:
        os.close(source)


def _exec_signals() -> None:
    """Signal dispositions as ``exec`` leaves them: a handler becomes the default (Python's own for
    SIGINT), an ignored signal stays ignored."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def forked_torchrun(parsed: Any, launch_config: Callable[[Any], tuple[Any, list[str]]],
                    run_worker: Callable[[list[str]], int]) -> None:
    """``torch.distributed.run.run(parsed)`` with each worker a fork of this agent that runs
    ``run_worker(["python", *worker_args])`` (its exit status: the worker's). ``launch_config``:
    torchrun's config for ``parsed`` with ``start_method="fork"``, and the worker's arguments."""
    from torch.distributed.launcher.api import elastic_launch

    config, cmd_args = launch_config(parsed)
    _name_rendezvous_events_cheaply()
    collecting = gc.isenabled()
    gc.disable()
    try:
        elastic_launch(config, _worker_entry)(run_worker, *cmd_args)
    finally:
        if collecting:
            gc.enable()


def _name_rendezvous_events_cheaply() -> None:
    """torch's rendezvous names each event it records after the calling method, which it finds with
    ``inspect.stack()``: the source lines of every frame on the stack, twice an event. In this agent,
    a fork many frames below the fork server's (scripts run by path, runpy's frozen frames), each
    call took 0.25-0.8 s on the test machine: 20-25 s of one agent's rendezvous in
    tests/distributed/test_elastic_nodes.py, so that on the loaded machine an agent joined its first
    round after the others had closed it. The same name, read from the frame itself (a fresh agent,
    as users start it, keeps torch's: its stack is short)."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name   # inspect.stack()[depth].function
        except ValueError:
            return "no_method_name"

    dynamic_rendezvous.get_method_name = method_name


def _worker_entry(run_worker: Callable[[list[str]], int], *cmd_args: str) -> None:
    """A worker: in a session of its own, as torchrun starts its subprocesses; ``python -u ...``."""
    from scaleloop.launching.forks import wait_for_siblings

    os.setsid()
    wait_for_siblings()
    args = list(cmd_args[1:]) if cmd_args[:1] == ("-u",) else list(cmd_args)   # -u: the fork's streams are unbuffered
    code = run_worker(["python", *args])
    if code:
        sys.exit(code)   # the exit status torchrun reads, as from a worker process of its own
