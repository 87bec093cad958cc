"""``python -m scaleloop.launching.agent LOG_FILE TORCHRUN_ARGS...``: torchrun, its own messages in a file.

This is torchrun: ``torch.distributed.run``'s own parser and elastic agent, unchanged. Only
where the agent's own messages go differs: its log lines, its failure summary ("Root Cause
...") and its traceback go to LOG_FILE instead of the console, because scaleloop's launcher
reads the workers' error files and prints a short report instead. The workers still inherit
the console (rank 0 shows its progress there).

It holds its lifeline to the launcher (``scaleloop.launching.lifeline``) before anything else,
and so do its workers to it: a launcher killed outright takes torchrun and the workers along.
While it lives it counts as a writer of the launcher's run directory (``join_writers``).

Where the machine has no GPU, the workers are forked from this process, which has imported
torch and the training loop once for all of them (``scaleloop.launching.worker.forked``):
each worker would otherwise spend seconds importing them itself (a fresh Python's ``import torch``
and torch.optim's first use of ``torch._dynamo``). They still run
``scaleloop.launching.worker``'s ``main`` exactly, each in its own session, as torchrun's own
workers do. With a GPU they are started as torchrun starts them, fresh: a fork cannot use CUDA
once the driver is started, and it must not be started here for them.
``SCALELOOP_FORK_WORKERS=0`` starts them fresh everywhere.

Exit codes: 0 when every worker succeeded, 1 when one failed, 128 + N on signal N (Ctrl-C: 130).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from scaleloop.launching.failures import EXIT_FILE_PREFIX

# torchrun's loggers (the launcher, the elastic agent) and Python warnings raised in it.
_LOGGERS = ("torch.distributed", "torch.multiprocessing", "py.warnings")
FORK_VAR = "SCALELOOP_FORK_WORKERS"
PROCESS_NAME = "sl-torchrun"   # as ps and top show it (the workers: sl-rank-<R>)
RANK_NAME = "sl-rank-"


def _log_to(path: str) -> None:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False


@contextlib.contextmanager
def logs_in(path: str) -> Iterator[None]:
    """While inside: torchrun's loggers write to ``path`` only; their handlers are put back after.

    For ``scaleloop.launch``, whose elastic agent is a fork of the caller (a notebook) that writes
    to its console: its failure messages and tracebacks would bury the short report the caller gets.
    """
    loggers = [logging.getLogger(name) for name in ("torch.distributed", "torch.multiprocessing")]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from scaleloop.launching import lifeline
    from scaleloop.output.lock import join_writers

    # First, before torch's slow import: a launcher that died meanwhile ends this process here.
    lifeline.hold()
    lifeline.set_name(PROCESS_NAME)
    join_writers()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m scaleloop.launching.agent LOG_FILE TORCHRUN_ARGS... (started by scaleloop's launcher)",
              file=sys.stderr)
        return 2
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _log_to(args[0])  # after the imports: importing torch sets up its own handlers
    log = logging.getLogger("torch.distributed.run")
    try:
        parsed = torchrun.parse_args(args[1:])
        if forks_workers(parsed):
            _run_forked(parsed)
        else:
            torchrun.run(parsed)
    except ChildFailedError as exc:
        log.error("%s", exc.format_msg())
        return 1
    except SignalException as exc:
        log.warning("stopped by signal %s", exc.sigval)
        return 128 + int(exc.sigval)
    except Exception:  # the agent itself failed (rendezvous, bad arguments): its traceback, in the log
        log.exception("torchrun failed")
        return 1
    return 0


def forks_workers_here(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether scaleloop's workers are forked on this machine: Linux without a GPU, unless turned off."""
    from scaleloop.runtime.devices import gpus_present

    environ = os.environ if environ is None else environ
    return environ.get(FORK_VAR, "1") != "0" and sys.platform.startswith("linux") and not gpus_present()


def forks_workers(parsed: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the workers of torchrun's ``parsed`` arguments are forked from this process:
    scaleloop's own worker module, where :func:`forks_workers_here`."""
    from scaleloop.launching.torchrun import WORKER_MODULE

    ours = parsed.module and not parsed.no_python and not parsed.run_path and parsed.training_script == WORKER_MODULE
    return bool(ours) and forks_workers_here(environ)


def forked_launch_config(parsed: argparse.Namespace) -> Any:
    """torchrun's launch config for its ``parsed`` arguments, with the workers forked from this
    process: what ``torch.distributed.run.run`` builds, plus ``start_method="fork"``."""
    from torch.distributed import run as torchrun

    # As torchrun's run() before it builds its launch config: --standalone is a c10d rendezvous
    # on a free port of this machine.
    one_machine = torchrun.parse_min_max_nnodes(parsed.nnodes)[1] == 1
    if parsed.standalone or (parsed.rdzv_backend == "static" and not parsed.rdzv_endpoint
                             and parsed.master_port is None and one_machine):
        parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if parsed.master_port is None:
        parsed.master_port = 29500
    config, _, _ = torchrun.config_from_args(parsed)
    config.start_method = "fork"
    return config


def _run_forked(parsed: argparse.Namespace) -> None:
    """``torch.distributed.run.run(parsed)``, with the workers forked from here (see the module doc)."""
    from torch.distributed.launcher.api import elastic_launch

    from scaleloop.launching import worker

    worker.preload(parsed.training_script_args[1])   # LOG_DIR MODULE ARGS...: the worker's entry
    config = forked_launch_config(parsed)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()   # nothing buffered here may be written again by a worker
    collecting = gc.isenabled()
    gc.disable()   # until every worker is forked and has frozen its copy (worker.forked)
    watch = ExitWatch(Path(parsed.training_script_args[0]))
    watch.start()
    try:
        elastic_launch(config, worker.forked)(*parsed.training_script_args)
    finally:
        watch.stop()
        if collecting:
            gc.enable()


class ExitWatch:
    """How each forked worker ended, written where the failure report reads it.

    torchrun's summary of forked workers names only the first that it found ended (often a rank
    that only lost its peer), not the one that died: ``os._exit``, SIGKILL from the out-of-memory
    killer. This watches this process's children and, as each ends, notes its exit status
    (``waitid`` with WNOWAIT: seen, but left for torchrun to collect) in
    ``LOG_DIR/exit-rank-<R>.txt``; the rank is the name each worker gives itself (``sl-rank-<R>``).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.seen, self.done = log_dir, set(), threading.Event()
        self.thread = threading.Thread(target=self._scan, name="scaleloop-exit-watch", daemon=True)

    def start(self) -> None:
        for old in self.log_dir.glob(f"{EXIT_FILE_PREFIX}*.txt"):   # an earlier launch's
            old.unlink(missing_ok=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def _scan(self) -> None:
        children = Path(f"/proc/self/task/{os.getpid()}/children")
        while not self.done.wait(0.1):
            try:
                pids = [int(p) for p in children.read_text().split()]
            except (OSError, ValueError):
                return   # no /proc here: the report names what torchrun names
            for pid in pids:
                if pid not in self.seen:
                    self.seen.add(pid)
                    threading.Thread(target=self._wait, args=(pid,), daemon=True).start()

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            name = Path(f"/proc/{pid}/comm").read_text().strip()   # readable until it is collected
        except (OSError, ChildProcessError):
            return
        if info is None or not name.startswith(RANK_NAME):
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        try:
            (self.log_dir / f"{EXIT_FILE_PREFIX}{name[len(RANK_NAME):]}.txt").write_text(f"{code}\n")
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
