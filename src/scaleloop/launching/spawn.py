"""``scaleloop.launch``: run a Python function in N worker processes, from a script or a notebook.

This is torchrun as a function call. PyTorch's elastic launcher (``torch.distributed.launcher``)
starts the workers, runs the rendezvous, sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT in each, restarts the group on failure if asked, and stops every worker when one
fails. scaleloop adds sane defaults, a start method that works in notebooks, rank 0's return
value, and failures that explain themselves: the caller gets one ``WorkerError`` whose message
is the short report of ``scaleloop.launching.failures`` (the rank that failed first, its
exception, the user's file:line; or the rank that stalled and where it was stuck), not the
agent's tracebacks. Its agent holds its lifeline to the caller and its workers theirs to the agent
(``scaleloop.launching.lifeline``), as torchrun's do: a killed script or notebook kernel takes
them along.

Its agent is started by ``scaleloop.launching.forks`` and watched by
``scaleloop.launching.supervisor``, as torchrun is for the CLI's commands: a fork of the caller (so that ``fn`` may be a notebook's function and its
workers forks of it), which holds its lifeline to the caller and hands rank 0's return value
back pickled. The elastic agent's signal handlers live in that fork, never in the caller.

Inside ``fn`` the worker sets itself up exactly as under torchrun::

    def train():
        env = scaleloop.DistEnv.from_env()
        scaleloop.init_process_group(env)
        ...
"""
from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Optional, Sequence, Union

from scaleloop.errors import EXIT_INTERRUPTED, UsageError
from scaleloop.launching import lifeline
from scaleloop.launching.failures import ELASTIC_DIR, LOGS_DIR, analyse, quiet_loader_workers, read_stack_dump
from scaleloop.launching.forks import wait_for_siblings

START_METHODS = ("auto", "fork", "spawn", "forkserver")

# The elastic agent installs handlers for these in its process, and its forked workers would
# inherit them (see _Worker.__call__).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker failed: its exception (type and message) or its exit code / signal."""

    rank: int
    exitcode: int
    error_type: Optional[str]
    message: str
    traceback: Optional[str] = None

    @property
    def description(self) -> str:
        """``"ValueError: bad shape"``, or what happened to a worker that did not raise."""
        return f"{self.error_type}: {self.message}" if self.error_type else self.message

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.description}"


class WorkerError(RuntimeError):
    """One or more workers of ``scaleloop.launch`` raised an exception or died.

    ``failures`` maps each failed global rank to a ``WorkerFailure``; ``report`` is the short
    report (the message, when the workers' records allowed one); the first failed worker's
    traceback, when it raised, is chained as this exception's cause.
    """

    def __init__(self, failures: Mapping[int, WorkerFailure], report: Sequence[str] = ()) -> None:
        self.failures = dict(sorted(failures.items()))
        self.report = list(report)
        if self.report:
            message = "\n".join(self.report)
        elif len(self.failures) == 1:
            (rank, failure), = self.failures.items()
            message = f"worker rank {rank} failed: {failure.description}"
        else:
            message = "workers failed: " + "; ".join(str(f) for f in self.failures.values())
        super().__init__(message)

    @property
    def ranks(self) -> list[int]:
        return list(self.failures)


class _RemoteTraceback(Exception):
    """The worker's own traceback, shown under the WorkerError (as concurrent.futures does)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + self.tb.rstrip()


class _Worker:
    """What each worker process calls: ``fn(*args, **kwargs)``, with torchrun's thread default.

    A module-level class, so that "spawn" can pickle it whenever ``fn`` itself can be pickled.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: Mapping[str, Any], threads: Optional[int],
                 logs: Optional[str] = None) -> None:
        self.fn, self.kwargs, self.threads, self.logs = fn, dict(kwargs), threads, logs
        self.launcher = os.getpid()   # set to the agent's pid in the agent: no worker outlives it
        self.collect = gc.isenabled()  # the caller's choice
        # The agent names the job after the entrypoint in its logs and errors.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        # A forked worker holds a copy of the caller's objects, garbage among them (an earlier
        # launch's store, a process group in a reference cycle): collected here, their destructors
        # would join threads and close sockets that exist only in the caller, and crash
        # (SIGSEGV while "Garbage-collecting"). The agent, a fork of the caller, never collects
        # (forks.start_function), so none runs in the worker before this line; from here on
        # the copies are never collected.
        gc.freeze()
        if self.collect:
            gc.enable()
        # A killed notebook kernel or script gives the agent no chance to stop its workers.
        lifeline.hold(self.launcher)
        # Before any name lookup: a fork taken while the agent's store resolved a sibling's address
        # holds the resolver's lock (scaleloop.launching.forks).
        wait_for_siblings()
        # A forked worker inherits the agent's handlers, which turn SIGTERM into a Python
        # exception that cannot interrupt a blocking C++ call (a rendezvous, a collective):
        # stopping it would wait out the agent's 30 s timeout. Start as a fresh process would.
        for name in _AGENT_SIGNALS:
            if hasattr(signal, name):
                default = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL
                signal.signal(getattr(signal, name), default)
        try:
            return self._run(args)
        except KeyboardInterrupt:
            # Ended on SIGINT: said by the exit code. torch's process wrapper takes a KeyboardInterrupt
            # for its own stop and ends the worker with 0 and no result, and the agent would wait
            # for that result for ever.
            raise SystemExit(EXIT_INTERRUPTED) from None

    def _run(self, args: tuple[Any, ...]) -> Any:
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        if self.logs is None:
            return self.fn(*args, **self.kwargs)
        rank = int(os.environ.get("RANK", "0"))
        dumps = _stack_dumps(Path(self.logs), rank)
        try:
            return self.fn(*args, **self.kwargs)
        except Exception as exc:
            _record(exc, rank, Path(self.logs))
            # Recorded: leave quietly. (An exception would be printed by multiprocessing and
            # recorded again, without scaleloop's part, by torch's own record around this call.)
            raise SystemExit(1) from None
        finally:
            faulthandler.unregister(signal.SIGTERM)
            faulthandler.disable()  # its file closes next; the caller's own faulthandler stays the parent's
            dumps.close()


def _stack_dumps(logs: Path, rank: int) -> IO[str]:
    """``logs/rank-<R>.log``, where SIGTERM (the agent stopping the survivors of a failure) first
    dumps every thread's Python stack: how the report finds where a stuck rank was. A crash
    (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) dumps it there too: how the report says where
    a rank that died without a Python exception was."""
    from scaleloop.launching.failures import ATTEMPT_MARK

    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"rank-{rank}.log", "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed by the caller
    log.write(f"{ATTEMPT_MARK} rank {rank}, attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}, "
              f"pid {os.getpid()} ====\n")
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=log, all_threads=True, chain=True)  # then ends as it would have
    return log


def _record(exc: BaseException, rank: int, logs: Path) -> None:
    """``exc`` in torchrun's error file, as ``scaleloop.launching.worker`` records it (its extras
    under ``extraInfo.scaleloop``), for the launcher's report."""
    quiet_loader_workers()   # first (no import before it): a DataLoader worker's end must not break the record
    from scaleloop.launching.worker import describe_exception, write_record

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time())),
        "scaleloop": describe_exception(exc, rank)}}}
    write_record(Path(path), data, logs, rank)


def launch(fn: Callable[..., Any], nproc: int, *, args: Sequence[Any] = (),
           kwargs: Optional[Mapping[str, Any]] = None, nnodes: Union[int, str] = 1,
           rdzv_endpoint: Optional[str] = None, rdzv_id: str = "scaleloop", max_restarts: int = 0,
           start_method: str = "auto", threads: Optional[int] = None, all_ranks: bool = False) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``nproc`` worker processes and return rank 0's result.

    Args:
        fn: the function each worker runs. Inside it, ``DistEnv.from_env()`` sees this worker's
            rank and ``init_process_group`` joins the group, as under torchrun.
        nproc: worker processes on this machine (one per GPU, or a few on a CPU).
        args, kwargs: passed to ``fn`` in every worker (pickled; keep them small).
        nnodes: machines in the job, ``N`` or elastic ``"MIN:MAX"``; more than one needs
            ``rdzv_endpoint``, and every machine calls ``launch`` with the same arguments.
        rdzv_endpoint: ``host:port`` of a c10d rendezvous (e.g. node 0). Default: a standalone
            rendezvous on a free localhost port, for one machine.
        rdzv_id: the job's name at the rendezvous, the same on every machine.
        max_restarts: times the whole worker group is restarted after a failure.
        start_method: how workers start. ``"fork"`` copies this process: works for functions
            defined in a notebook or ``__main__``, lambdas and closures, starts fast, but
            cannot be used once CUDA is initialised here. ``"spawn"`` starts fresh
            interpreters: CUDA-safe and clean, but slower to start, and ``fn`` and its
            arguments must be picklable and importable by module name. ``"auto"`` (default):
            fork on a Linux machine without GPUs; spawn where there is a GPU (the CUDA
            driver may have started here already), on macOS and Windows; fork a function
            that cannot be spawned while CUDA is not initialised (see ``choose_start_method``).
        threads: CPU threads per worker. Default: as torchrun, 1 when several workers share
            this machine and OMP_NUM_THREADS is not set (else torch's own default).
        all_ranks: return ``{global rank: result}`` for this machine's workers instead.

    Returns:
        rank 0's return value (None on a machine that does not hold rank 0), which must be
        picklable; return tensors on the CPU.

    Raises:
        WorkerError: a worker raised or died; the message names the rank(s) and the error.
        UsageError: bad arguments, said in one line.
    """
    min_nodes, max_nodes = _check_args(nproc, nnodes, rdzv_endpoint, max_restarts)
    method = resolve_start_method(start_method, fn)
    if threads is None and nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = 1

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from scaleloop.launching import forks, supervisor
    from scaleloop.launching.torchrun import WorkerLaunch

    worker = _Worker(fn, kwargs or {}, threads)
    # Workers' error files and stack dumps go to a directory of our own, removed afterwards:
    # the elastic default is a fresh /tmp/torchelastic_* per call, left behind. The agent's
    # own messages and rank 0's result go there too.
    with tempfile.TemporaryDirectory(prefix="scaleloop-launch-") as tmp:
        run_dir = Path(tmp)
        logs = run_dir / LOGS_DIR
        logs.mkdir()
        worker.logs = str(logs)
        config = LaunchConfig(
            min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
            rdzv_backend="c10d",
            # Port 0: the agent binds a free port itself, as `torchrun --standalone` does.
            rdzv_endpoint=rdzv_endpoint or "localhost:0",
            run_id=rdzv_id if rdzv_endpoint else uuid.uuid4().hex,
            max_restarts=max_restarts, start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=str(logs / ELASTIC_DIR)),
        )
        agent = _Agent(config, worker, tuple(args), run_dir)
        described = WorkerLaunch(nproc=nproc, module="scaleloop.launch", logs=logs, nnodes=max_nodes,
                                 max_restarts=max_restarts)
        ended = supervisor.wait_out(forks.start_function(agent, described))
        results = agent.outcome(run_dir, ended.code)
    return dict(results) if all_ranks else results.get(0)


class _Agent:
    """torch's elastic agent running ``worker`` in its workers: the body of the fork that
    ``scaleloop.launching.forks.start_function`` starts. It leaves its outcome in ``out``:
    the results by rank, the workers' failures, or its own exception (pickled), which
    :meth:`outcome` reads in the caller."""

    def __init__(self, config: Any, worker: _Worker, args: tuple[Any, ...], out: Path) -> None:
        self.config, self.worker, self.args, self.out = config, worker, args, out

    def __call__(self) -> int:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        from scaleloop.launching.agent import logs_in

        self.worker.launcher = os.getpid()   # the workers hold their lifeline to this agent
        try:
            with logs_in(str(self.out / LOGS_DIR / "agent.log")):
                results = elastic_launch(self.config, self.worker)(*self.args)
        except ChildFailedError as exc:
            _dump(self.out / "failures.pkl", {rank: _failure(rank, pf) for rank, pf in exc.failures.items()})
            return 1
        except SignalException as exc:
            return 128 + int(exc.sigval)   # it stopped the workers; the caller says why
        except Exception as exc:   # the agent's own failure (a rendezvous that timed out, ...): the caller's to raise
            try:
                _dump(self.out / "error.pkl", exc)
            except Exception:   # an exception that cannot be pickled: its text and traceback
                _dump(self.out / "error.pkl", RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            return 1
        _dump(self.out / "results.pkl", dict(results))
        return 0

    @staticmethod
    def outcome(out: Path, code: int) -> dict[int, Any]:
        """The results by rank; WorkerError for failed workers; the agent's own exception; for an
        agent stopped by Ctrl-C (``code``: 128 + SIGINT), KeyboardInterrupt, as Ctrl-C is here."""
        if (out / "failures.pkl").is_file():
            from scaleloop.launching.supervisor import INTERRUPTED_CODES

            failures = _load(out / "failures.pkl")
            codes = [f.exitcode for f in failures.values()]
            if any(c in INTERRUPTED_CODES for c in codes) and all(c in (*INTERRUPTED_CODES, -signal.SIGTERM)
                                                                  for c in codes):
                # A worker ended on SIGINT and the agent stopped the others: Ctrl-C, as here.
                raise KeyboardInterrupt
            error = WorkerError(failures, _report(out, failures))
            # The worker's traceback as the cause; torch's own exception adds nothing to it.
            raise error from _remote_traceback(error)
        if (out / "error.pkl").is_file():
            raise _load(out / "error.pkl")
        if not (out / "results.pkl").is_file():
            if code == 128 + signal.SIGINT:
                raise KeyboardInterrupt
            stopped = f"signal {signal.Signals(code - 128).name}" if 128 < code < 128 + 65 else f"exit code {code}"
            raise RuntimeError(f"launch: the workers' agent ended without a result ({stopped}); its workers "
                               "were stopped with it")
        return _load(out / "results.pkl")


def _dump(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _check_args(nproc: Any, nnodes: Union[int, str], rdzv_endpoint: Optional[str],
                max_restarts: int) -> tuple[int, int]:
    """``launch``'s arguments checked, each refusal one line; the job's fewest and most machines."""
    min_nodes, max_nodes = _parse_nnodes(nnodes)
    if not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"launch: nproc must be a positive whole number, not {nproc!r}")
    if max_restarts < 0:
        raise UsageError(f"launch: max_restarts must be zero or positive, not {max_restarts}")
    if max_nodes > 1 and not rdzv_endpoint:
        raise UsageError(f"launch: nnodes={nnodes!r} needs rdzv_endpoint='HOST:PORT', where the machines meet")
    return min_nodes, max_nodes


def resolve_start_method(requested: str, fn: Callable[..., Any]) -> str:
    """The start method for ``fn``: ``auto`` resolved, and the choice checked (UsageError if it cannot work).

    Gathers the facts (platform, GPUs present, CUDA initialised here, whether ``fn`` can be
    imported by a fresh Python) and lets :func:`choose_start_method` decide.
    """
    if requested not in START_METHODS:
        raise UsageError(f"launch: unknown start_method {requested!r}; choose one of: {', '.join(START_METHODS)}")
    import torch

    from scaleloop.runtime.devices import gpus_present

    return choose_start_method(requested, platform=sys.platform, available=multiprocessing.get_all_start_methods(),
                               gpus=gpus_present(), cuda_initialised=torch.cuda.is_initialized(),
                               not_importable=_not_importable(fn))


def choose_start_method(requested: str, *, platform: str, available: Sequence[str], gpus: bool,
                        cuda_initialised: bool, not_importable: Optional[str]) -> str:
    """The start method, from the facts alone (no torch, no processes): the rule ``auto`` follows.

    ``auto`` forks only where that is safe and spawning is not needed: on Linux, with no GPU
    on the machine. With a GPU it spawns: ``torch.cuda.is_available()`` (called by nearly every
    script or notebook) starts the CUDA driver, and forked workers then fail with "CUDA error:
    initialization error" at their first CUDA call, whether or not torch reports CUDA as
    initialised. It spawns on macOS and Windows too (fork is unsafe there, or missing). A
    function that a fresh interpreter cannot import (a notebook's, a lambda, a closure) is
    forked anyway, while CUDA is not initialised here: the only way it can run.
    ``fork`` or ``spawn`` asked for by name is checked, never changed.
    """
    if requested not in START_METHODS:
        raise UsageError(f"launch: unknown start_method {requested!r}; choose one of: {', '.join(START_METHODS)}")
    method = requested
    if requested == "auto":
        fork_safe = platform.startswith("linux") and not gpus and not cuda_initialised
        method = "fork" if "fork" in available and (fork_safe or not_importable is not None) else "spawn"
    if method not in available:
        raise UsageError(f"launch: start_method {method!r} is not available on this platform; "
                         f"use one of: {', '.join(available)}")
    if method == "fork" and cuda_initialised:
        if requested == "auto":  # fork only because fn cannot be spawned
            raise UsageError(f"launch: CUDA is already initialised in this process, so workers must be spawned, "
                             f"but {not_importable}; move fn to a module, or call launch before any CUDA work")
        raise UsageError("launch: CUDA is already initialised in this process, so forked workers cannot use it; "
                         "call launch before any CUDA work (restart the kernel), or use start_method='spawn'")
    if method != "fork" and not_importable is not None:
        raise UsageError(f"launch: start_method={method!r} needs fn importable by a fresh Python, but "
                         f"{not_importable}; move it to a module, or use start_method='fork'")
    return method


def _defined_in_main(fn: Callable[..., Any]) -> bool:
    return getattr(fn, "__module__", None) == "__main__"


def _not_importable(fn: Callable[..., Any]) -> Optional[str]:
    """Why a fresh interpreter could not find ``fn``, or None when it can."""
    main = sys.modules.get("__main__")
    if _defined_in_main(fn) and not getattr(main, "__file__", None):
        return "it is defined in a notebook or an interactive session"
    try:
        pickle.dumps(fn)
    except Exception:  # pickle raises several types; any of them means "spawn cannot send it"
        return "it cannot be pickled (a lambda, a nested function or a closure?)"
    return None


def _parse_nnodes(nnodes: Union[int, str]) -> tuple[int, int]:
    text = str(nnodes).strip()
    low, _, high = text.partition(":")
    try:
        min_nodes, max_nodes = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"launch: nnodes must be N or 'MIN:MAX', not {nnodes!r}") from None
    if not 1 <= min_nodes <= max_nodes:
        raise UsageError(f"launch: nnodes {nnodes!r} needs 1 <= MIN <= MAX")
    return min_nodes, max_nodes


def _report(run_dir: Path, failures: Mapping[int, WorkerFailure]) -> list[str]:
    """The short report on this machine's workers (the first line without the CLI's prefix).

    None (an empty list) when no worker raised and none left a crash dump in its log: their
    exit codes or signals say it as well.
    """
    logs = run_dir / LOGS_DIR
    if not any(f.error_type for f in failures.values()):
        dumps = (read_stack_dump(logs / f"rank-{rank}.log") for rank in failures)
        if not any(dump is not None and dump.fatal for dump in dumps):
            return []
    ranks = sorted(set(failures) | {int(p.stem.partition("-")[2]) for p in logs.glob("rank-*.log")})
    failure = analyse(run_dir, logs / ELASTIC_DIR, ranks, None, 1, None, doctor=False, log_lines=False,
                      timeout_name="init_process_group's timeout_s")
    # The failure the report puts first leads the chained traceback too.
    report = failure.report
    return [report[0].replace("scaleloop: error: ", "", 1), *report[1:]] if report else []


def _remote_traceback(error: WorkerError) -> Optional[_RemoteTraceback]:
    listed = sorted(error.failures.values(), key=lambda f: f.rank != _first_rank(error))
    first = next((f for f in listed if f.traceback), None)
    return None if first is None else _RemoteTraceback(f"worker rank {first.rank}:\n{first.traceback}")


def _first_rank(error: WorkerError) -> Optional[int]:
    """The rank the report names first ("rank 1 of 2 failed", "rank 1 stopped taking part")."""
    head = error.report[0] if error.report else ""
    for rank in error.failures:
        if head.startswith(f"rank {rank} ") or f": rank {rank} stopped" in head:
            return rank
    return None


def _failure(rank: int, process_failure: Any) -> WorkerFailure:
    """Read torch's ProcessFailure: the error file's record when the worker raised, else its exit status."""
    exitcode = process_failure.exitcode
    record = process_failure.message
    # torch's @record wrapper writes {"message": "Type: text", "extraInfo": {"py_callstack": ...}};
    # without an error file the message is torch's generic hint, of no use here.
    if isinstance(record, dict) and record.get("message"):
        error_type, _, text = str(record["message"]).partition(": ")
        tb = record.get("extraInfo", {}).get("py_callstack")
        return WorkerFailure(rank, exitcode, error_type, text, tb)
    if isinstance(record, str) and process_failure.error_file_data.get("message") not in (None, "<NONE>"):
        return WorkerFailure(rank, exitcode, None, record)
    if exitcode < 0:
        return WorkerFailure(rank, exitcode, None, f"killed by signal {process_failure.signal_name()}")
    return WorkerFailure(rank, exitcode, None, f"exited with code {exitcode} (no Python exception recorded; see its output)")
