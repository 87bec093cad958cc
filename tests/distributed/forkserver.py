"""A fork server for the tests' ``python -m scaleloop ...`` (and ``python script.py``) runs.

Most of what a short multi-process test costs is Python starting: ``import torch`` and
``torch._dynamo`` (which torch.optim's first step imports) take about 4 CPU-seconds here, and
the suite starts a few hundred such runs. This server is started once per pytest process,
imports them once (and draws one ``curves.png``, which loads matplotlib and fills its caches), and
forks one child per run. The child starts as the fresh interpreter the
command stands for: its own session, default signal handlers, no exit
handlers of the server, its own environment, working directory, ``sys.argv`` and
``sys.path[0]``, its output in files, and ``__main__`` run by ``runpy``; at its end it joins its
threads and runs its exit handlers as an interpreter does.

``python -m torch.distributed.run ... SCRIPT`` (or ``... -m MODULE``) goes one step further: torchrun's own parser,
rendezvous and elastic agent run in the child, and the script's (the module's) workers are forked from it
(``_torchrun``); each starts as the fresh worker it stands
for and ends with the exit status and traceback one would. ``SCALELOOP_TEST_FORK_TORCHRUN=0``
leaves those workers fresh. And the torchrun agent that ``scaleloop train --nproc N`` (``verify``,
``bench``) starts, and its workers, are forks too (``forked_launch.py``, which says what differs
from the users' path and which tests take that path instead).

The server itself runs no tensor operation and starts no thread, so a fork of it is as clean
as a fresh interpreter. ``tests/distributed/procs.py`` is its client; ``SCALELOOP_TEST_FRESH=1`` makes
every run a fresh interpreter again.

Protocol (JSON lines; a request whose ``stderr`` is its ``stdout`` merges them, as ``2>&1``): the server says ``{"ready": pid}``; each request
``{"argv", "env", "cwd", "stdout", "stderr"}`` gets ``{"pid": ...}`` once forked and
``{"code": ...}`` (``subprocess``'s return code) once the child has ended.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import logging
import os
import runpy
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from pathlib import Path
from typing import Any

import forked_launch

# ``python -m torch.distributed.run SCRIPT``: its workers forked from the run's fork (unless "0").
FORK_TORCHRUN_VAR = "SCALELOOP_TEST_FORK_TORCHRUN"
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.launcher.api", "scaleloop.cli",
           "scaleloop.launching.worker", "scaleloop.launching.agent", "scaleloop.launching.launcher",
           "scaleloop.loop.training", "scaleloop.loop.build", "scaleloop.strategies.factory",
           "scaleloop.strategies.ddp", "torch.nn.parallel")


def _streams() -> None:
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")
    # Unbuffered, as the tests' PYTHONUNBUFFERED=1 makes a fresh interpreter.
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True,
                                  encoding="utf-8", errors="strict")
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  encoding="utf-8", errors="backslashreplace")


def _paths(argv: list[str], cwd: str, env: dict[str, str]) -> None:
    """``sys.path`` as a fresh interpreter would have it: the script's folder (or the working
    directory for ``-m``) first, then PYTHONPATH, then the rest."""
    first = {"-m": cwd, "-c": ""}.get(argv[1]) if argv[1] in ("-m", "-c") else os.path.dirname(os.path.abspath(argv[1]))
    rest = [p for p in sys.path[1:]]
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first] + [p for p in extra if p not in rest] + rest


def _script_worker(script: str, *args: str) -> None:
    """A worker of :func:`_torchrun`: starts as the fresh ``python -u SCRIPT ARGS`` torchrun
    would start, runs it, and ends as it would (its exit status; its traceback on its stderr)."""
    code = _run_worker(["python", script, *args])
    if code:
        sys.exit(code)   # the exit status torchrun reads, as from a worker process of its own


def _run_worker(argv: list[str]) -> int:
    """In a worker forked by torchrun's agent: ``argv`` run as the fresh worker would start and
    end (its exit handlers, its threads joined); its exit status."""
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    gc.freeze()
    gc.enable()
    atexit._clear()
    logging.captureWarnings(False)
    for logger in (logging.getLogger(n) for n in ("torch.distributed", "torch.multiprocessing", "py.warnings")):
        logger.handlers, logger.propagate = [], True
    _streams()
    _threads()
    _paths(argv, os.getcwd(), dict(os.environ))
    code = _run(argv)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _threads() -> None:
    """torch's thread count from OMP_NUM_THREADS, as a fresh ``import torch`` reads it."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _torchrun(args: list[str]) -> None:
    """``python -m torch.distributed.run ARGS SCRIPT ...`` (or ``-m MODULE ...``) with the script's
    (the module's) workers forked from here: torchrun's own parser, rendezvous and elastic agent;
    only the workers are not fresh interpreters. (For users ``scaleloop train`` forks nothing: see
    ``forked_launch.py``.)"""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    parsed = torchrun.parse_args(args)
    if parsed.no_python or parsed.run_path:
        record(torchrun.run)(parsed)
        return
    if parsed.module:   # ``-m MODULE``: as the agent of ``scaleloop train --nproc N`` runs it (forked_launch.py)
        record(lambda p: forked_launch.forked_torchrun(p, lambda q: forked_launch_config(q, with_args=True),
                                                       _run_worker))(parsed)
        return
    config = forked_launch_config(parsed)
    collecting = gc.isenabled()
    gc.disable()
    try:
        record(elastic_launch(config, _script_worker))(parsed.training_script, *parsed.training_script_args)
    finally:
        if collecting:
            gc.enable()


def forked_launch_config(parsed: Any, with_args: bool = False) -> Any:
    """torchrun's launch config for its ``parsed`` arguments, with the workers forked from this
    process: what ``torch.distributed.run.run`` builds, plus ``start_method="fork"`` (``with_args``:
    and the worker's command line after ``python``)."""
    from torch.distributed import run as torchrun

    # As torchrun's run() before it builds its launch config: --standalone is a c10d rendezvous
    # on a free port of this machine.
    one_machine = torchrun.parse_min_max_nnodes(parsed.nnodes)[1] == 1
    if parsed.standalone or (parsed.rdzv_backend == "static" and not parsed.rdzv_endpoint
                             and parsed.master_port is None and one_machine):
        parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if parsed.master_port is None:
        parsed.master_port = 29500
    config, _, cmd_args = torchrun.config_from_args(parsed)
    config.start_method = "fork"
    return (config, cmd_args) if with_args else config


def _run(argv: list[str]) -> int:
    """Run ``argv`` (``python -m MODULE ...``, ``python -c CODE ...`` or ``python SCRIPT ...``);
    its exit status."""
    try:
        if argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[2], "<string>", "exec"), main.__dict__)
        elif argv[1:3] == ["-m", "torch.distributed.run"] and os.environ.get(FORK_TORCHRUN_VAR) != "0":
            sys.argv = [argv[2], *argv[3:]]
            _torchrun(argv[3:])
        elif argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            # Preloaded, the module would run as a second copy of itself (runpy warns): as in a
            # fresh interpreter, ``__main__`` is its only copy until something imports it.
            sys.modules.pop(argv[2], None)
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -int(signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _child(request: dict) -> None:
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        if request["stderr"] == request["stdout"]:   # 2>&1
            os.dup2(1, 2)
        else:
            os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    _become(request["argv"], request["cwd"])


def _become(argv: list[str], cwd: str) -> None:
    """In a fork whose descriptors, environment and signals are set: run ``argv`` as the fresh
    interpreter it stands for, and end as it would. Never returns."""
    code = 1
    try:
        gc.freeze()
        gc.enable()
        atexit._clear()
        tempfile.tempdir = None   # read from this run's TMPDIR again, as a fresh interpreter does
        os.chdir(cwd)
        _streams()
        _threads()
        _paths(argv, cwd, dict(os.environ))
        if forked_launch.forks_launches(dict(os.environ)):
            forked_launch.install(_become)
            if forked_launch.is_agent_command([sys.executable, *argv[1:]]):
                from torch.distributed import run as torchrun

                torchrun.run = lambda parsed: forked_launch.forked_torchrun(
                    parsed, lambda p: forked_launch_config(p, with_args=True), _run_worker)
        code = _run(argv)
        threading._shutdown()  # type: ignore[attr-defined]  # as an interpreter's end joins them
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:   # ended by a signal, as a fresh interpreter ends on an uncaught Ctrl-C
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _warm_plotting() -> None:
    """Draw one ``curves.png`` (into a folder removed at once), as rank 0 of a run does at its end:
    each fork then finds matplotlib's modules, its font list and its text caches loaded. Drawn cold
    in a fork, the figure cost 0.45-0.52 CPU-seconds; warm, 0.20-0.25 (the suite draws about 400)."""
    try:
        from matplotlib import font_manager
    except ImportError:
        return
    from scaleloop.output.metrics import plot_curves

    # The fonts the figure loads keep their files open, read by a seek then a read of a descriptor
    # (and so an offset) that every fork would share: forgotten here, each fork opens its own.
    forget_fonts = getattr(getattr(font_manager, "_get_font", None), "cache_clear", None)
    if forget_fonts is None:   # another matplotlib: no figure drawn here
        return
    with tempfile.TemporaryDirectory(prefix="sl-warm-") as folder:
        csv = Path(folder) / "metrics.csv"
        csv.write_text("kind,epoch,step,train_loss,test_loss,test_acc\nstep,1,1,2.3,,\nstep,1,2,2.1,,\n"
                       "epoch,1,2,2.2,2.25,0.31\n", encoding="utf-8")
        plot_curves(csv, Path(folder) / "curves.png")
    forget_fonts()


def main() -> None:
    sys.path[0] = os.getcwd()   # not this file's folder: each child sets its own (_paths)
    for name in PRELOAD:
        importlib.import_module(name)
    _warm_plotting()
    _say({"ready": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        gc.disable()   # the child's copies of the server's objects are never collected there
        pid = os.fork()
        if pid == 0:
            _child(request)
        gc.enable()
        _say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _say({"code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
