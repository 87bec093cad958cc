"""The entry point of each worker that scaleloop's launcher starts under torchrun.

``python -m scaleloop.launching.worker LOG_DIR MODULE [ARGS...]`` runs ``MODULE.main(ARGS)`` (the
``scaleloop`` command, or the verify worker) so that a failure explains itself:

- this rank's output goes to ``LOG_DIR/rank-<R>.log``; rank 0 also shows its normal output
  (progress, summary) on the console, but never a traceback;
- an exception is recorded with torchrun's own ``record`` into the error file torchrun names
  (``TORCHELASTIC_ERROR_FILE``), with scaleloop's extras under ``extraInfo.scaleloop``: the
  rank, epoch and step, the user's innermost frame, the collective a rank waited in when it
  timed out, and a precise time to order the ranks' failures;
- SIGTERM (torchrun stopping the survivors of a failure) first dumps every thread's Python
  stack into the log with ``faulthandler``, which works even while the rank is blocked inside
  a C++ call: it is how the launcher finds where a stuck rank was.
- a stop signal (SIGUSR1 from the launcher through torchrun; also SIGTERM under SLURM) is
  noted, not fatal: the loop stops after its step with a checkpoint (``scaleloop.runtime.preempt``);
- it holds its lifeline to torchrun (``scaleloop.launching.lifeline``): a killed torchrun (or a
  killed launcher, which takes torchrun along) ends it, so it never writes on alone; and it
  counts as a writer of the run directory while it lives (``scaleloop.output.lock.join_writers``).
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Callable, Optional, Sequence

from scaleloop.runtime.collector import collection_paused

with collection_paused():   # torch's import: objects that live as long as the process (runtime.collector)
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from scaleloop.launching import lifeline
from scaleloop.launching.console import console_stream
from scaleloop.runtime import preempt
from scaleloop.errors import EXIT_INTERRUPTED
from scaleloop.launching.failures import leave_unrecorded, quiet_loader_workers
from scaleloop.runtime.frames import Frame, FrameKinds, noted_sample, where_of, worker_traceback
from scaleloop.runtime.recovery import leave_fault
from scaleloop.runtime.slurm import in_slurm_job

# Written at the start of each attempt in a rank's log; the launcher reads only what follows
# the last one (torchrun may restart the group with --max-restarts).
ATTEMPT_MARK = "==== scaleloop worker"
# Exception text that says a collective failed because of another rank, not this one.
_COMM_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out",
                 "timeout", "broken pipe", "processgroup", "socket", "c10d")
_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog")


def log_path(log_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its log."""
    return log_dir / f"rank-{rank}.log"


class _Tee:
    """A text stream that writes to the console and the log; ``mute()`` leaves only the log.

    Progress-bar redraws (text holding a carriage return) reach the console only, so that the
    log keeps lines, not thousands of redraws.
    """

    #: Its console is a ``console_stream`` already (:func:`main`): ``launching.console.kept_console``
    #: leaves it in place rather than write past the log.
    console_kept = True

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self._console: Optional[IO[str]] = console
        self._log: Optional[IO[str]] = log
        self._real = console

    def write(self, text: str) -> int:
        if self._console is not None:
            self._console.write(text)
        if "\r" not in text and self._log is not None:
            try:
                self._log.write(text)
            except OSError:
                self._lost_log()
        return len(text)

    def flush(self) -> None:
        if self._console is not None:
            self._console.flush()
        if self._log is not None:
            try:
                self._log.flush()
            except OSError:
                self._lost_log()

    def _lost_log(self) -> None:
        # A log that cannot be written (its disk is full) must not take the console with it:
        # Python would drop sys.stderr, and with it the report of what went wrong.
        self._log = None

    def isatty(self) -> bool:
        return self._console is not None and self._console.isatty()

    def log_only(self, text: str) -> None:
        """Write ``text`` to the log alone: a library's chatter that the console need not show
        (torchft's checkpoint server's requests: ``strategies.fault_tolerant``)."""
        if self._log is not None:
            try:
                self._log.write(text)
            except OSError:
                self._lost_log()

    def mute(self) -> None:
        if self._console is not None:
            self._console.flush()
        self._console = None

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, buffer, ...: the console's
        return getattr(self._real, name)


class _RankErrorHandler(ErrorHandler):
    """torchrun's error handler, with faulthandler aimed at this rank's log and scaleloop's extras."""

    def __init__(self, rank: int, log: IO[str], log_dir: Path) -> None:
        self.rank, self.log, self.log_dir = rank, log, log_dir

    def initialize(self) -> None:
        faulthandler.enable(file=self.log, all_threads=True)
        # chain=True: after the dump, SIGTERM ends the process as it would have.
        faulthandler.register(signal.SIGTERM, file=self.log, all_threads=True, chain=True)

    def record_exception(self, e: BaseException) -> None:
        quiet_loader_workers()
        described = describe_exception(e, self.rank)
        # For the next attempt of an elastic job: what ended this one, and when (runtime.recovery).
        leave_fault(self.log_dir, self.rank, described, int(os.environ.get("WORLD_SIZE", "1") or 1))
        path = self._get_error_file_path()
        if not path:
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
            "py_callstack": traceback.format_exc(),
            "timestamp": str(int(time.time())),
            "scaleloop": described,
        }}}
        write_record(Path(path), data, self.log_dir, self.rank)


def write_record(path: Path, data: dict[str, Any], log_dir: Path, rank: int) -> None:
    """``data`` as ``path`` (a worker's error file), replaced at once: the agent never reads half a
    file. Where the disk takes no more (full, read-only), the part written is removed and an empty
    file says so to the launcher instead (``failures.leave_unrecorded``): the exception this rank
    raised then goes on to end it as it would have, not an ``OSError`` of its record."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        leave_unrecorded(log_dir, rank, exc)


def describe_exception(exc: BaseException, rank: int) -> dict[str, Any]:
    """What the launcher's report needs about ``exc``, as JSON-ready values."""
    frames = _tb_frames(exc.__traceback__)
    summary = [Frame(f.f_code.co_filename, line, f.f_code.co_name) for f, line in frames]
    text = str(exc).lower()
    communication = _is_communication_error(exc, text)
    error_type, message = type(exc).__name__, str(exc)
    remote = worker_traceback(message)
    if remote is not None:
        # Raised in a DataLoader worker process and raised again here: the place and the error are
        # the worker's (its traceback comes as text), not scaleloop's loop that asked for the batch.
        summary = remote.frames
        error_type, message = remote.error_type or error_type, remote.described()
    elif (ended := _loader_worker_ended(message, frames)) is not None:
        # A worker process that died raised nothing: no line of code is its cause.
        summary, message = [], ended
    elif isinstance(exc, (ConnectionError, EOFError)) and (ended := _dead_loader_worker(frames)) is not None:
        # The batch's hand-over found its worker gone before torch's own check did: the same death.
        summary, error_type, message = [], "RuntimeError", ended
    elif (sample := noted_sample(exc)) is not None:   # the dataset raised, read in this process
        message = f"{message} (reading sample {sample})"
    frame = FrameKinds().innermost_user(summary)
    return {
        "rank": rank, **where_of(exc),
        "error_type": error_type,
        "message": message,
        "frame": str(frame) if frame is not None else None,
        "communication": communication,
        "timed_out": communication and any(m in text for m in _TIMEOUT_MARKERS),
        "waiting_in": describe_collective(frames) if communication else None,
        "time": time.time(),
    }


# torch's words for a DataLoader worker that ended without a Python error: its SIGCHLD handler's,
# and the batch wait's that found it gone.
_LOADER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: (.+?)\.?\s*$", re.S)
_LOADER_EXITED = re.compile(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")


def _loader_worker_ended(message: str, frames: Sequence[tuple[FrameType, int]]) -> Optional[str]:
    """torch's message for a DataLoader worker process that died, said with its signal and the likely
    cause (None for any other message). The exit status, where torch's words lack it, is read from
    the DataLoader iterator on the stack (its worker processes, which know theirs)."""
    killed, exited = _LOADER_KILLED.search(message), _LOADER_EXITED.search(message)
    if killed is not None:
        pid = int(killed[1])
        sig = next((s for s in signal.Signals if signal.strsignal(s) == killed[2].strip()), None)
        code = -sig if sig is not None else None
    elif exited is not None:
        pid = int(exited[1].split(",")[0])
        code = _worker_exit_code(pid, frames)
    else:
        return None
    return _worker_end_said(pid, code)


def _worker_end_said(pid: Optional[int], code: Optional[int]) -> str:
    """DataLoader worker ``pid``'s end in words: its exit code, or its signal and the likely cause."""
    if code is None or code >= 0:
        return (f"a DataLoader worker (pid {pid}) exited unexpectedly"
                + (f" with code {code}" if code is not None else "") + " (os._exit, a crash, or a signal)")
    name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else f"signal {-code}"
    said = f"a DataLoader worker (pid {pid}) was killed by signal {name}"
    if -code == signal.SIGKILL:
        said += ": most often the kernel's out-of-memory killer (see `dmesg`); fewer --num-workers use less memory"
    return said


def _dead_loader_worker(frames: Sequence[tuple[FrameType, int]]) -> Optional[str]:
    """A DataLoader worker process of an iterator on the stack that has ended with an error (said
    as :func:`_loader_worker_ended` says it), or None."""
    for frame, _ in reversed(frames):
        for process in getattr(frame.f_locals.get("self"), "_workers", None) or ():
            code = getattr(process, "exitcode", None)
            if isinstance(code, int) and code != 0:
                return _worker_end_said(getattr(process, "pid", None), code)
    return None


def _worker_exit_code(pid: int, frames: Sequence[tuple[FrameType, int]]) -> Optional[int]:
    """The exit code of DataLoader worker ``pid`` (negative: its signal), from the iterator on the stack."""
    for frame, _ in reversed(frames):
        for process in getattr(frame.f_locals.get("self"), "_workers", None) or ():
            if getattr(process, "pid", None) == pid:
                code = getattr(process, "exitcode", None)
                return code if isinstance(code, int) else None
    return None


def _tb_frames(tb: Optional[TracebackType]) -> list[tuple[FrameType, int]]:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _is_communication_error(exc: BaseException, text: str) -> bool:
    """A collective or the rendezvous failed: typically the follow-on of another rank's failure."""
    try:
        from torch.distributed import DistError

        if isinstance(exc, DistError):
            return True
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    return isinstance(exc, (RuntimeError, OSError, TimeoutError)) and any(m in text for m in _COMM_MARKERS)


def describe_collective(frames: Sequence[tuple[FrameType, int]]) -> Optional[str]:
    """Which collective a failed communication was in, named from this rank's Python frames.

    ``all_reduce in sum_over_ranks (path:line)`` when a ``torch.distributed`` call is on the
    stack; the gradient all-reduce (DDP) or reduce-scatter (FSDP) when it was the backward pass.
    """
    kinds = FrameKinds()
    paths = [f.f_code.co_filename.replace(os.sep, "/") for f, _ in frames]
    if any("torch/autograd/" in p for p in paths):
        wrapper = _parallel_wrapper(f for f, _ in frames)
        if wrapper == "ddp":
            return "gradient all-reduce in backward (DDP)"
        if wrapper == "fsdp":
            return "gradient reduce-scatter in backward (FSDP)"
    calls = [f for p, (f, _) in zip(paths, frames) if "torch/distributed/" in p
             and not f.f_code.co_name.startswith("_") and f.f_code.co_name not in ("wrapper", "wait")]
    if calls:
        op = calls[-1].f_code.co_name
        callers = [(f, line) for p, (f, line) in zip(paths, frames) if "torch/distributed/" not in p
                   and kinds.kind(f.f_code.co_filename) in ("user", "scaleloop") and f.f_code.co_name != "wrapper"]
        if callers:
            f, line = callers[-1]
            return f"{op} in {f.f_code.co_name} ({f.f_code.co_filename}:{line})"
        return op
    if any("torch/autograd/" in p for p in paths):
        return "a collective in the backward pass"
    if any(p.endswith("torch/nn/parallel/distributed.py") for p in paths):
        return "DDP's forward (buffer broadcast or unused-parameter check)"
    return None


def _parallel_wrapper(frames: Any) -> Optional[str]:
    """``ddp`` or ``fsdp`` when a frame on the stack holds such a model (as ``model`` or ``self``)."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()  # type: ignore[assignment,misc]
    for frame in frames:
        for name in ("model", "self", "module"):
            value = frame.f_locals.get(name)
            if isinstance(value, DistributedDataParallel):
                return "ddp"
            if FSDPModule and isinstance(value, FSDPModule):
                return "fsdp"
    return None


def _open_log(log_dir: Path, rank: int) -> IO[str]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_path(log_dir, rank), "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives with the process
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        log.write(f"{ATTEMPT_MARK} rank {rank}, attempt {attempt}, pid {os.getpid()}, "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%S')} ====\n")
    except OSError:
        pass   # a full disk: the run goes on, and says so in one line where it needs room itself
    return log


def _route_output(rank: int, log: IO[str]) -> list[_Tee]:
    """Rank 0: console and log (tees, returned so they can be muted). Other ranks: the log only,
    at the file-descriptor level, so that C++ messages land there too."""
    if rank != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        return []
    tees = [_Tee(sys.stdout, log), _Tee(sys.stderr, log)]
    sys.stdout, sys.stderr = tees[0], tees[1]  # type: ignore[assignment]
    return tees


def run(log_dir: Path, main: Callable[[list[str]], Optional[int]], argv: list[str]) -> int:
    """Run ``main(argv)`` as one recorded worker of the job; returns the exit code."""
    from scaleloop.runtime.dist import RUNNER_RECORDS_VAR, destroy_process_group, global_rank

    rank = global_rank()
    log = _open_log(log_dir, rank)
    tees = _route_output(rank, log)

    def mute() -> None:
        for tee in tees:
            tee.mute()

    def on_interrupt(signum: int, frame: Optional[FrameType]) -> None:
        # The launcher prints the one line about it; this rank's own goes to its log.
        mute()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    # Stop signals (scaleloop.runtime.preempt) are noted, and the loop stops after its step; the
    # launcher prints the one line about it. Installed before record() registers faulthandler on
    # SIGTERM, which then dumps the stacks first and chains to this handler.
    preempt.listen(preempt.stop_signals(None, torchrun_worker=True, slurm=in_slurm_job(os.environ)),
                   on_signal=lambda _sig: mute())
    # A failed run leaves its process group open for this runner to close once the error is
    # recorded (scaleloop.runtime.dist.end_process_group says why).
    os.environ[RUNNER_RECORDS_VAR] = "1"
    try:
        code = record(main, error_handler=_RankErrorHandler(rank, log, log_dir))(argv)
    except KeyboardInterrupt:
        mute()
        print("interrupted", file=log)
        return EXIT_INTERRUPTED
    except Exception:  # recorded in the error file by record(); the traceback goes to the log only
        mute()
        traceback.print_exc(file=log)
        return 1
    finally:
        destroy_process_group()   # a failed run's (a finished run has left it: nothing to do)
        for tee in tees:
            tee.flush()
    return int(code or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from scaleloop.output.lock import join_writers

    lifeline.hold()
    join_writers()
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m scaleloop.launching.worker LOG_DIR MODULE [ARGS...] (started by scaleloop's launcher)",
              file=sys.stderr)
        return 2
    log_dir, module, rest = Path(args[0]), args[1], args[2:]
    # Writes that go nowhere once the console's reader has gone (launching.console).
    sys.stdout = console_stream(1, sys.stdout, sys.stdout.errors or "strict")
    sys.stderr = console_stream(2, sys.stderr, "backslashreplace")
    entry = importlib.import_module(module).main
    return run(log_dir, entry, rest)


if __name__ == "__main__":
    from scaleloop.runtime.exiting import exit_process

    exit_process(main())
