"""After workers failed: which rank failed first and where, or which rank stalled; a short report.

The launcher calls :func:`analyse` when torchrun reports a failure. It reads only what the
workers and torchrun left in the run directory (no console text):

- torchrun's error files (``logs/torchrun/<launch>/<run id>/attempt_<K>/<local rank>/error.json``),
  written by ``record`` in each worker that raised (``scaleloop.launching.worker``), each with its
  rank, epoch, step, exception, the user's innermost frame and a precise time;
- the ranks' logs (``logs/rank-<R>.log``): a rank that raised nothing but was stopped by torchrun
  ends with its faulthandler stack dump, which says where it was.

A rank whose own code raised is the root cause; the others' errors (a peer closed the
connection) are its consequences. When every error is a collective's timeout, the run stalled:
the rank behind is the one that did not time out, and its stack says where it was stuck.
The result is printed (at most ~15 lines) and written as ``failure.json`` for ``scaleloop doctor``.
"""
from __future__ import annotations

import errno
import json
import linecache
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from scaleloop.errors import EXIT_USAGE
from scaleloop.output.endings import FAILURE_FILE, Failure  # (re-exported: the launch side names them from here)
from scaleloop.output.rundir import LOGS_DIR  # (re-exported: the launch side names it from here)
from scaleloop.runtime.frames import Frame, FrameKinds
from scaleloop.runtime.recovery import AGENT_LOG  # (re-exported) under LOGS_DIR: torchrun's own messages

ELASTIC_DIR = "torchrun"           # under LOGS_DIR: torchrun's --log-dir, one folder per launch
ATTEMPT_MARK = "==== scaleloop worker"  # = scaleloop.launching.worker.ATTEMPT_MARK (no torch here)

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):\s*$|^Stack \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<path>.+)", line (?P<line>\d+) in (?P<name>.+?)\s*$')


@dataclass(frozen=True)
class RankError:
    """One rank's recorded exception (from its torchrun error file)."""

    rank: int
    error_type: str
    message: str
    frame: Optional[str] = None
    epoch: Optional[int] = None
    step: Optional[int] = None
    communication: bool = False
    timed_out: bool = False
    waiting_in: Optional[str] = None
    time: float = 0.0
    during: Optional[str] = None      # not a training step: "the evaluation after epoch 1", ...


@dataclass(frozen=True)
class StackDump:
    """The last stack dump in a rank's log: its main thread's frames (outermost first)."""

    frames: tuple[Frame, ...]
    fatal: Optional[str] = None     # "Segmentation fault" when the dump is a crash's

    def waiting(self) -> bool:
        """Blocked in a collective (torch.distributed or the backward pass), not in its own code."""
        inner = self.frames[-1].path.replace(os.sep, "/") if self.frames else ""
        return "torch/distributed/" in inner or "torch/autograd/" in inner


def read_error_files(elastic_dir: Path) -> dict[int, RankError]:
    """The recorded exceptions of the last attempt in ``elastic_dir``, by global rank."""
    attempts = sorted(elastic_dir.glob("*/attempt_*"), key=lambda p: (_attempt(p), p.stat().st_mtime))
    if not attempts:
        return {}
    found: dict[int, RankError] = {}
    for path in sorted(attempts[-1].glob("*/error.json")):
        error = _read_error_file(path)
        if error is not None:
            found[error.rank] = error
    return found


def _attempt(path: Path) -> int:
    try:
        return int(path.name.rpartition("_")[2])
    except ValueError:
        return -1


def _read_error_file(path: Path) -> Optional[RankError]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    ours = extra.get("scaleloop")
    if isinstance(ours, dict) and isinstance(ours.get("rank"), int):
        known = {k: ours[k] for k in RankError.__dataclass_fields__ if k in ours}
        return RankError(**known)
    # A worker without scaleloop's handler: torch's own record (its directory is the local rank).
    error_type, _, text = str(message.get("message", "")).partition(": ")
    try:
        rank, when = int(path.parent.name), float(extra.get("timestamp", 0))
    except ValueError:
        return None
    return RankError(rank, error_type, text, time=when)


def _last_attempt(log: Path) -> Optional[str]:
    """What ``log`` holds from its last attempt's mark on (all of it without a mark; None if unreadable)."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text[text.rfind(ATTEMPT_MARK):] if ATTEMPT_MARK in text else text


def read_stack_dump(log: Path) -> Optional[StackDump]:
    """The main thread's stack from the last faulthandler dump of the last attempt in ``log``."""
    text = _last_attempt(log)
    if text is None:
        return None
    lines = text.splitlines()
    blocks: list[list[Frame]] = []
    fatal: Optional[str] = None
    for line in lines:
        if line.startswith("Fatal Python error: "):
            fatal, blocks = line[len("Fatal Python error: "):].strip(), []
        elif _THREAD.match(line):
            blocks.append([])
        elif blocks and (m := _FRAME.match(line)):
            blocks[-1].append(Frame(m["path"], int(m["line"]), m["name"]))
    # The last dump's threads follow its first header; the main thread is the one that was not
    # started by threading (its outermost frame is not threading's _bootstrap).
    mains = [b for b in blocks if b and not (b[-1].path.endswith("threading.py") and b[-1].name == "_bootstrap")]
    if not mains:
        return StackDump((), fatal) if fatal else None
    return StackDump(tuple(reversed(mains[-1])), fatal)


# A rank that cannot write its error record, or the message of the usage error it stopped on (its
# disk is full or read-only), leaves an empty file under LOGS_DIR named after it and the errno,
# ``unrecorded-rank-<R>.<ENOSPC>``, instead: a name takes no room on the disk, a file's contents do.
UNRECORDED_PREFIX = "unrecorded-rank-"


def leave_unrecorded(log_dir: Path, rank: int, exc: OSError) -> None:
    """Say (for the launcher) that rank ``rank`` could not write a record because of ``exc``."""
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    try:
        (log_dir / f"{UNRECORDED_PREFIX}{rank}.{name}").touch()
    except OSError:
        pass   # not even a name fits: the launcher's own look at the disk is all there is


def take_unrecorded(log_dir: Path, only: Optional[list[int]] = None) -> dict[int, str]:
    """The ranks that left :func:`leave_unrecorded`'s file, with the errno's name; the files are
    removed (``only``: those of these ranks, the others' are another machine's)."""
    found: dict[int, str] = {}
    for path in log_dir.glob(f"{UNRECORDED_PREFIX}*"):
        rank, _, name = path.name[len(UNRECORDED_PREFIX):].partition(".")
        if not rank.isdigit() or (only is not None and int(rank) not in only):
            continue
        found[int(rank)] = name
        path.unlink(missing_ok=True)
    return found


def remove_partial_records(paths: Iterable[Path]) -> None:
    """Remove the temporary files (``*.tmp-<pid>``) among ``paths`` (files, or folders searched
    through) that the workers' records left when their disk filled up: a record is written
    through one and renamed once whole, so that a reader never sees half; once the workers have
    ended, one that is left was never finished."""
    for root in paths:
        for path in root.rglob("*.tmp-*") if root.is_dir() else [root]:
            if path.name.rpartition(".tmp-")[2].isdigit():
                try:
                    path.unlink()
                except OSError:
                    pass


_SUMMARY = "Failures:"      # torchrun's summary of a failed launch: every failed worker, then the first
_ROOT_CAUSE = "Root Cause (first observed failure):"
_ENTRY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ENTRY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def exit_codes(logs: Path) -> dict[int, int]:
    """Each failed worker's exit code (negative: killed by that signal), from torchrun's own summary
    in ``logs/torchrun.log``, the first observed failure first; empty when it says none."""
    return _summary_codes(logs / AGENT_LOG)


def _summary_codes(agent_log: Path) -> dict[int, int]:
    try:
        text = agent_log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    if _ROOT_CAUSE not in text:
        return {}
    summary = text[text.rfind(_SUMMARY, 0, text.rindex(_ROOT_CAUSE)):] if _SUMMARY in text else text
    root = summary[summary.index(_ROOT_CAUSE):]
    found: dict[int, int] = {}
    for block in (root, summary):   # the root cause's entry first
        rank = None
        for line in block.splitlines():
            if m := _ENTRY_RANK.match(line):
                rank = int(m[1])
            elif rank is not None and (m := _ENTRY_EXIT.match(line)):
                found.setdefault(rank, int(m[1]))
                rank = None
    return found


def _ended(code: int) -> str:
    """How a process that raised nothing ended, with the likely reason."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return (f"was killed by {name}: most often the kernel's out-of-memory killer (see `dmesg`), "
                    "or a kill -9")
        return f"was killed by {name}"
    return (f"exited with code {code} and no Python error (os._exit, or a library that ended the "
            "process itself)")


def analyse(run_dir: Path, elastic_dir: Path, ranks: list[int], timeout_s: Optional[float],
            exit_code: int, continue_line: Optional[str], *, doctor: bool = True, log_lines: bool = True,
            timeout_name: str = "--timeout", machines: int = 1) -> Failure:
    """What happened to the workers of one launch, with the report to print (see the module doc).

    ``run_dir`` holds ``logs/rank-<R>.log``; ``elastic_dir`` is torchrun's ``--log-dir`` of the
    launch. The report ends with where the logs are (with ``log_lines``: they hold each rank's
    output); with ``doctor`` (a run directory that ``scaleloop doctor`` reads) the
    ``failure.json`` line; and ``continue_line`` when given. ``timeout_name`` is what sets the
    collectives' timeout for this caller (a flag, or ``scaleloop.launch``'s argument). ``machines``:
    how many machines the job has (at most); where this machine's ranks only lost their peers, the
    report says that the cause is on another one.
    """
    errors = read_error_files(elastic_dir)
    ranks = sorted(set(ranks) | set(errors))
    logs = {str(r): f"{LOGS_DIR}/rank-{r}.log" for r in ranks}
    dumps = {r: read_stack_dump(run_dir / LOGS_DIR / f"rank-{r}.log") for r in ranks if r not in errors}
    own = sorted((e for e in errors.values() if not e.communication), key=lambda e: e.time)
    if own:
        failure = _failed(own[0], errors, dumps, len(ranks))
    elif any(e.timed_out for e in errors.values()):
        failure = _stalled(errors, dumps, timeout_s, timeout_name)
    else:
        failure = _died(errors, dumps, exit_code, run_dir, len(ranks), machines)
    failure.logs = logs
    if log_lines:
        failure.report += _log_lines(run_dir, failure.rank, ranks)
    if doctor:
        failure.report.append(f"  record: {run_dir / FAILURE_FILE} (read it again with: scaleloop doctor {run_dir})")
    if continue_line:
        failure.report.append(f"  {continue_line}")
    return failure


def _short(message: str, limit: int = 160) -> str:
    """The first line of an error message, without Gloo's leading ``[file.cc:123]``, cut to ``limit``
    (at the end of its first sentence when that is too long)."""
    text = (message.strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    if len(text) > limit and ". " in text[:limit]:
        text = text[:text.index(". ", 0, limit) + 1]
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def _at(epoch: Optional[int], step: Optional[int], during: Optional[str] = None) -> str:
    """Where a failure happened: " in the evaluation after epoch 1", " at epoch 2, step 14"."""
    if during:
        return f" in {during}" if during.startswith("the ") else f" while {during}"
    parts = ([f"epoch {epoch}"] if epoch is not None else []) + ([f"step {step}"] if step is not None else [])
    return f" at {', '.join(parts)}" if parts else ""


def one_process(run_dir: Optional[Path], described: dict[str, Any], continue_line: Optional[str]) -> Failure:
    """The report of a run that failed in one process (no torchrun): the same short report as a
    worker's failure under ``--nproc N``. ``described`` is ``worker.describe_exception``'s; the
    full traceback is in ``run_dir/logs/rank-0.log`` (no log and record lines without ``run_dir``)."""
    error = RankError(**{k: described[k] for k in RankError.__dataclass_fields__ if k in described})
    failure = _failed(error, {error.rank: error}, {}, 1)
    if run_dir is not None:
        log = run_dir / LOGS_DIR / f"rank-{error.rank}.log"
        failure.logs = {str(error.rank): f"{LOGS_DIR}/{log.name}"}
        failure.report += [f"  traceback: {log}",
                           f"  record: {run_dir / FAILURE_FILE} (read it again with: scaleloop doctor {run_dir})"]
    if continue_line:
        failure.report.append(f"  {continue_line}")
    return failure


def _failed(first: RankError, errors: dict[int, RankError], dumps: dict[int, Optional[StackDump]],
            n_ranks: int) -> Failure:
    who = f"rank {first.rank} of {n_ranks} failed" if n_ranks > 1 else "the run failed"
    lines = [f"scaleloop: error: {who}{_at(first.epoch, first.step, first.during)}: "
             f"{first.error_type}: {_short(first.message)}"]
    if first.frame:
        lines += [f"  raised at: {first.frame}"] + _source(first.frame)
    others = [e for e in errors.values() if e.rank != first.rank]
    own = [e for e in others if not e.communication]
    follow = [e for e in others if e.communication]
    if own:
        lines.append("  also raised: " + "; ".join(f"rank {e.rank}: {e.error_type}: {_short(e.message, 60)}"
                                                     for e in sorted(own, key=lambda e: e.time)[:3]))
    stopped = sorted(r for r in dumps)
    if follow or stopped:
        parts = []
        if follow:
            parts.append(f"{_ranks(e.rank for e in follow)} lost {'its' if len(follow) == 1 else 'their'} peer "
                         f"({follow[0].error_type}: {_short(follow[0].message, 60)})")
        if stopped:
            parts.append(f"{_ranks(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped by torchrun")
        lines.append("  then: " + "; ".join(parts) + " (consequences, not causes)")
    return Failure("failed", first.rank, first.epoch, first.step, first.error_type, first.message, first.frame,
                   during=first.during, report=lines)


def _stalled(errors: dict[int, RankError], dumps: dict[int, Optional[StackDump]],
             timeout_s: Optional[float], timeout_name: str = "--timeout") -> Failure:
    waited = sorted((e for e in errors.values() if e.timed_out), key=lambda e: e.time)
    first = waited[0]
    behind = [r for r, d in sorted(dumps.items()) if d is None or not d.waiting()] or sorted(dumps)
    kinds = FrameKinds()
    where = None
    if behind and dumps.get(behind[0]) is not None:
        frame = kinds.innermost_user(dumps[behind[0]].frames)  # type: ignore[union-attr]
        where = str(frame) if frame is not None else None
    limit = f"{timeout_s:g} s" if timeout_s else "its timeout"
    if behind:
        who = _ranks(behind)
        head = (f"scaleloop: error: the run stalled{_at(first.epoch, first.step)}: {who} stopped taking part; "
                f"{_ranks(e.rank for e in waited)} gave up waiting after {limit} ({timeout_name})")
    else:
        who = "a rank on another node"
        head = (f"scaleloop: error: the run stalled{_at(first.epoch, first.step)}: "
                f"{_ranks(e.rank for e in waited)} gave up waiting after {limit} ({timeout_name}) for a rank on "
                "another node (see that node's report)")
    lines = [head]
    if behind:
        lines += [f"  {who} was at: {where or 'an unknown place (no stack dump in its log)'}"] + _source(where)
    lines.append(f"  {_ranks(e.rank for e in waited)} waited in: {first.waiting_in or 'a collective'}"
                 f" ({first.error_type}: {_short(first.message, 80)})")
    lines.append(f"  if {who} was only slow (a long first torch.compile, a large checkpoint), raise {timeout_name}"
                 + (f" (now {limit})" if timeout_s else ""))
    return Failure("stalled", behind[0] if behind else None, first.epoch, first.step, first.error_type,
                   first.message, where, first.waiting_in, report=lines)


def _died(errors: dict[int, RankError], dumps: dict[int, Optional[StackDump]], exit_code: int,
          run_dir: Path, n_ranks: int = 0, machines: int = 1) -> Failure:
    """No rank raised an error of its own: one crashed or was killed (or torchrun itself failed)."""
    crashed = [r for r, d in sorted(dumps.items()) if d is not None and d.fatal]
    silent = [r for r, d in sorted(dumps.items()) if d is None]
    # The rank that died is one that left neither an error nor a stack dump (torchrun's own stop
    # leaves a dump; a peer's lost connection, an error), with its exit code in torchrun's summary.
    codes = {} if crashed else exit_codes(run_dir / LOGS_DIR)
    dead = [r for r in codes if r in silent] or [r for r in codes if r not in errors and r not in dumps]
    cause = (dead[0], codes[dead[0]]) if dead else None
    rank = crashed[0] if crashed else (cause[0] if cause else (silent[0] if silent and errors else None))
    of = f" of {n_ranks}" if n_ranks > 1 else ""
    lines: list[str] = []
    frame = None
    if crashed:
        dump = dumps[crashed[0]]
        assert dump is not None
        frame = FrameKinds().innermost_user(dump.frames)
        lines.append(f"scaleloop: error: rank {rank} crashed: {dump.fatal}")
        if frame is not None:
            lines.append(f"  at: {frame}")
    elif cause is not None and (said := _said_usage_error(run_dir, rank, cause[1])) is not None:
        lines.append(f"scaleloop: error: rank {rank}{of} stopped on bad input: {said}")
    elif cause is not None:
        lines.append(f"scaleloop: error: rank {rank}{of} {_ended(cause[1])}")
        last = _last_words(run_dir / LOGS_DIR / f"rank-{rank}.log")
        if last:
            lines.append(f"  its log ends with: {last}")
    elif rank is not None:
        lines.append(f"scaleloop: error: rank {rank} ended without a Python error (killed by a signal, out of memory, "
                     "or a crash in C++); the other ranks then lost their peer")
    else:
        lines.append(f"scaleloop: error: {_agent_failed(run_dir / LOGS_DIR / AGENT_LOG, exit_code)}")
    others = {r: e for r, e in errors.items() if r != rank}
    if others:
        first = min(others.values(), key=lambda e: e.time)
        their = "its" if len(others) == 1 else "their"
        lines.append(f"  then: {_ranks(others)} lost {their} peer ({first.error_type}: {_short(first.message, 60)})")
        if rank is None and machines > 1:   # nothing here failed of itself: a rank elsewhere did
            lines.append("  cause: on another machine of the job (this machine's ranks only lost their peers); "
                         "its console, logs and failure.json say what happened there")
    # What doctor says after "failed on rank R: ".
    message = (f"crashed: {dumps[crashed[0]].fatal}" if crashed  # type: ignore[union-attr]
               else lines[0].partition(": error: ")[2] if cause is None or "stopped on bad input" in lines[0]
               else _ended(cause[1]))
    return Failure("failed", rank, message=message, frame=str(frame) if frame is not None else None, report=lines)


def _said_usage_error(run_dir: Path, rank: Optional[int], code: int) -> Optional[str]:
    """What rank ``rank`` said before it ended with ``code``, where that is a usage error's exit
    code and its log's last line one (scaleloop's one-line error): bad input, not a crash."""
    if rank is None or code != EXIT_USAGE:
        return None
    last = _last_line(run_dir / LOGS_DIR / f"rank-{rank}.log")
    return last[len(_USAGE_LINE):] if last is not None and last.startswith(_USAGE_LINE) else None


_AGENT_ERROR = re.compile(r"^(?:[\w.]+\.)?(?P<type>\w*(?:Error|Exception|Failure)\w*): (?P<message>.+)$")
_PORT_IN_USE = re.compile(r"port: (?P<port>\d+).*(?:EADDRINUSE|address already in use)", re.IGNORECASE)


def _agent_failed(agent_log: Path, exit_code: int) -> str:
    """What torchrun itself failed with, in one line, when no worker recorded anything: a port in
    use named as such, else the last exception in its own log."""
    try:
        lines = agent_log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    errors = [m for m in map(_AGENT_ERROR.match, (line.strip() for line in lines)) if m]
    if errors and (port := _PORT_IN_USE.search(errors[-1]["message"])):
        return (f"port {port['port']} is already in use, so torchrun could not start the workers' rendezvous "
                "there; choose a free port with --master-port")
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    said = (f"with {errors[-1]['type']}: {_short(errors[-1]['message'], 120)}" if errors
            else f"with this last message: {_short(last, 120)}" if last else "without a message")
    return f"the workers failed (torchrun exit code {exit_code}) and recorded no Python error; torchrun ended {said}"


_USAGE_LINE = "scaleloop: error: "


def usage_error_in_logs(run_dir: Path, ranks: list[int]) -> Optional[tuple[int, str]]:
    """The first of ``ranks`` that stopped on bad input, and its one-line message, read from its
    log: a rank that says ``scaleloop: error: ...`` last and did not end with another exit code
    than :data:`~scaleloop.errors.EXIT_USAGE` (where torchrun's summary names one). A rank leaves
    the message in a file for its launcher too, but in a run directory that several machines
    share another machine's launcher may have taken it; the log stays."""
    codes = exit_codes(run_dir / LOGS_DIR)
    for rank in sorted(ranks):
        if codes.get(rank, EXIT_USAGE) != EXIT_USAGE:
            continue
        last = _last_line(run_dir / LOGS_DIR / f"rank-{rank}.log")
        if last is not None and last.startswith(_USAGE_LINE):
            return rank, last[len(_USAGE_LINE):]
    return None


def _last_line(log: Path) -> Optional[str]:
    text = _last_attempt(log) or ""
    lines = [line.strip() for line in text.splitlines()[1 if ATTEMPT_MARK in text else 0:] if line.strip()]
    return lines[-1] if lines else None


def _last_words(log: Path) -> Optional[str]:
    """The last line a rank wrote to its log this attempt (its last progress), cut short."""
    text = _last_attempt(log) or ""
    lines = [line for line in text.splitlines()[1 if ATTEMPT_MARK in text else 0:] if line.strip()]
    return _short(lines[-1], 120) if lines else None


def _source(frame: Optional[str]) -> list[str]:
    """The line of code at ``path:line in name``, indented as in a traceback (none if unreadable)."""
    if not frame:
        return []
    where = frame.rpartition(" in ")[0] or frame
    path, _, line = where.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return [f"      {_short(text, 120)}"] if text else []


def _ranks(ranks: Any) -> str:
    listed = sorted(set(ranks))
    if len(listed) == 1:
        return f"rank {listed[0]}"
    shown = ", ".join(str(r) for r in listed[:8]) + (f" and {len(listed) - 8} more" if len(listed) > 8 else "")
    return f"ranks {shown}"


def _log_lines(run_dir: Path, rank: Optional[int], ranks: list[int]) -> list[str]:
    logs = run_dir / LOGS_DIR
    if not ranks:   # no worker wrote a log: torchrun's own messages are all there is
        return [f"  torchrun's messages: {logs / AGENT_LOG}"]
    if rank is None:
        return [f"  logs: {logs}/rank-<N>.log (one per rank); torchrun's messages: {logs / AGENT_LOG}"]
    return [f"  logs: {logs / f'rank-{rank}.log'} (rank {rank}'s full output); every rank: {logs}/rank-<N>.log"]


def quiet_loader_workers() -> None:
    """Let the DataLoader's worker processes end in peace while this rank reports its failure.

    torch's SIGCHLD handler (set by a DataLoader with worker processes) raises a RuntimeError in
    whatever code runs when one of its workers ends: once this rank failed, its other workers end
    too, and that error would break the very record of the failure (no error file, and the report
    "no Python error"). The rank is ending: the default (nothing) is what it needs now.
    """
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is not None and callable(signal.getsignal(sigchld)):
        try:
            signal.signal(sigchld, signal.SIG_DFL)
        except ValueError:   # not the main thread: torch set none there either
            pass
