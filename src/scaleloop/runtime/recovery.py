"""How long an elastic job took to get over a fault, measured from what each attempt leaves behind.

When a worker's attempt ends by an exception (a peer's machine died or was cut off, and the
collective it waited in failed; or the agent stopped it to admit a returning machine), it
leaves ``logs/fault-rank-<R>.json`` on its own machine (:func:`leave_fault`): when it failed, the
last time it made progress, its step and the world size. The next attempt's first process on
each machine reads its machine's files, rank 0 puts them together (:func:`gather_faults`) and,
once the new group has taken its first step, reports the recovery (:class:`Recovery`): in the
run's output, as a ``recovery`` row of ``metrics.csv`` and in ``recovery.json``, which
``scaleloop doctor`` reads. The times are wall-clock times of different machines: they are as
exact as the machines' clocks agree (NTP: milliseconds).

A survivor stopped by torchrun before its collective failed leaves no record; the rank that died
(SIGKILL, a crash) never leaves one. So the next attempt also reads what torchrun itself saw, in
its own log on the machine (:func:`last_worker_exit`): which worker ended, how, and when; and a
restarted group (``TORCHELASTIC_RESTART_COUNT`` > 0) is reported even when no record was left.

The phases, as the survivors see them:

- noticed: from the last progress any surviving rank made to the first survivor's failure
  (at once for a machine that died: its connections drop; after ``--timeout`` for one cut off);
- new group: from that failure to the restarted group's process group (the agents' restart,
  the rendezvous with its ``last_call_timeout``, the workers' start);
- first step: from there to the end of the new group's first optimizer step (building the
  run, loading the checkpoint, one step).
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

FAULT_PREFIX = "fault-rank-"
RECOVERY_FILE = "recovery.json"
AGENT_LOG = "torchrun.log"   # under the run's logs/: torchrun's own messages (scaleloop.launching.agent)
# torchrun's line for a worker that ended badly (torch.distributed.elastic.multiprocessing.api).
_WORKER_EXIT = re.compile(r"^(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d+) .*"
                          r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<rank>\d+)")


@dataclass(frozen=True)
class WorkerExit:
    """A worker whose end torchrun saw: its local rank, exit code (negative: the signal) and when."""

    local_rank: int
    code: int
    time: float

    def how(self) -> str:
        """"was killed by SIGKILL", "exited with code 3"."""
        if self.code < 0:
            try:
                return f"was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                return f"was killed by signal {-self.code}"
        return f"exited with code {self.code}"


def last_worker_exit(log_dir: Path) -> Optional[WorkerExit]:
    """The last worker that torchrun saw fail, from ``log_dir/torchrun.log`` (None: none, or no log)."""
    try:
        lines = (log_dir / AGENT_LOG).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if m := _WORKER_EXIT.match(line):
            when = time.mktime(time.strptime(m["when"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
            return WorkerExit(int(m["rank"]), int(m["code"]), when)
    return None


def leave_fault(log_dir: Path, rank: int, described: dict[str, Any], world_size: int) -> None:
    """Write this rank's fault record (``described``: ``worker.describe_exception``'s dict)."""
    record = {**described, "rank": rank, "world_size": world_size, "agent": os.getppid(),
              "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}
    path = log_dir / f"{FAULT_PREFIX}{rank}.json"
    try:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass   # a full or read-only disk: the failure report still goes through torchrun's error file


def take_faults(log_dir: Optional[Path]) -> list[dict[str, Any]]:
    """This machine's fault records of the attempt before, removed once read (each is reported once).

    Only records left under the same torchrun agent (this process's parent) count: one left by an
    earlier launch of the run (a failure that ended it; the launcher also clears them, see
    :func:`clear_faults`) is no fault this launch recovered from.
    """
    if log_dir is None or not log_dir.is_dir():
        return []
    found = []
    for path in sorted(log_dir.glob(f"{FAULT_PREFIX}*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            path.unlink()
        except (OSError, ValueError):
            continue
        if record.get("agent") in (None, os.getppid()):
            found.append(record)
    return found


def clear_faults(log_dir: Path) -> None:
    """Remove the fault records of an earlier launch (the launcher, before it starts the workers)."""
    for path in log_dir.glob(f"{FAULT_PREFIX}*.json"):
        path.unlink(missing_ok=True)


@dataclass
class Recovery:
    """One recovery of an elastic job, as rank 0 reports it."""

    world_before: int
    world_after: int
    lost_ranks: list[int]                 # ranks of the attempt before that left no record (their machine is gone)
    cause: str                            # what the survivors saw, in words
    last_progress: float                  # wall time of the last progress a survivor made
    noticed: float                        # ... of the first survivor's failure
    group_formed: float                   # ... when the new process group was formed
    resumed_step: Optional[int] = None    # the checkpoint's step the new group resumed from
    first_step: Optional[float] = None    # ... when the new group's first optimizer step ended
    records: list[dict[str, Any]] = field(default_factory=list)
    restart: Optional[int] = None         # torchrun's restart that formed the new group (1: the first)
    max_restarts: Optional[int] = None    # --max-restarts
    failed_step: Optional[int] = None     # the step the survivors were in when the fault came (None: unknown)
    replica_group: Optional[int] = None   # --replica-groups: the group that was lost and rejoined
    left_after_step: Optional[int] = None  # ... the last step all groups trained, as a live group saw it
    rejoined_step: Optional[int] = None   # ... the first step it trained again, with a live group's state

    @classmethod
    def from_records(cls, records: list[dict[str, Any]], world_after: int, group_formed: float, *,
                     restart: int = 0, max_restarts: Optional[int] = None,
                     died: Optional[WorkerExit] = None) -> Optional["Recovery"]:
        """None for a first attempt that found no records (an elastic job's admitted machine
        leaves records). ``died``: the worker torchrun saw fail (:func:`last_worker_exit`), named
        when its rank left no record of its own; given only where local and global ranks agree."""
        if not records and restart == 0:
            return None
        numbered = dict(restart=restart or None, max_restarts=max_restarts)
        if not records:   # every process was stopped or died before it could write one
            who = f"rank {died.local_rank} of {world_after} {died.how()}" if died else "a worker failed"
            noticed = died.time if died else group_formed
            return cls(world_before=world_after, world_after=world_after,
                       lost_ranks=[died.local_rank] if died else [], cause=f"{who} (torchrun's log)",
                       last_progress=noticed, noticed=noticed, group_formed=group_formed, **numbered)
        # (With a shared run directory, two machines may both have read a record.)
        records = list({(r.get("rank"), r.get("time")): r for r in records}.values())
        world_before = max(int(r.get("world_size") or 0) for r in records)
        seen = {int(r["rank"]) for r in records if "rank" in r}
        lost = [r for r in range(world_before) if r not in seen]
        own = [r for r in records if not r.get("communication") and r.get("error_type") != "Preempted"]
        if world_after > world_before and not own:
            # The agents stop the group to admit a machine: its ranks see their peers go.
            cause = f"a machine joined: the agents restarted the group of {world_before} process(es) to admit it"
            lost = []
        elif own:
            first = min(own, key=lambda r: r.get("time", 0))
            cause = f"rank {first['rank']} failed: {first.get('error_type')}: {str(first.get('message', ''))[:120]}"
        elif died is not None and lost == [died.local_rank]:   # torchrun saw how the lost rank ended
            cause = f"rank {died.local_rank} of {world_before} {died.how()}"
        else:
            timed_out = any(r.get("timed_out") for r in records)
            who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "a peer"
            cause = (f"{who} of {world_before} stopped answering: " +
                     ("the others' collective timed out (--timeout), as when a machine is cut off" if timed_out else
                      "its connections dropped, as when a process or its machine dies"))
        progress = [float(r["last_progress"]) for r in records if r.get("last_progress")]
        times = [float(r["time"]) for r in records if r.get("time")]
        steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
        noticed = min(times) if times else group_formed
        return cls(world_before=world_before, world_after=world_after, lost_ranks=lost, cause=cause,
                   last_progress=max(progress) if progress else noticed, noticed=noticed,
                   group_formed=group_formed, records=records, failed_step=max(steps) if steps else None,
                   **numbered)

    @property
    def phases(self) -> dict[str, Optional[float]]:
        """Seconds: noticed, new group, first step, and in all (None until the first step)."""
        return {"noticed_s": max(0.0, self.noticed - self.last_progress),
                "new_group_s": max(0.0, self.group_formed - self.noticed),
                "first_step_s": None if self.first_step is None else max(0.0, self.first_step - self.group_formed),
                "total_s": None if self.first_step is None else max(0.0, self.first_step - self.last_progress)}

    def describe(self) -> str:
        """The line the run prints once the new group has taken its first step."""
        p = self.phases
        size = (f"a new group of {self.world_after} process(es) (was {self.world_before})"
                if self.world_after != self.world_before else f"a new group of {self.world_after} process(es)")
        which = ""
        if self.restart:
            of = f" of {self.max_restarts}" if self.max_restarts else ""
            which = f" (torchrun's restart {self.restart}{of})"
        during = f" in step {self.failed_step}" if self.failed_step is not None else ""
        text = (f"recovered{which}: {self.cause}{during}; noticed {p['noticed_s']:.1f} s after the last step, "
                f"{size} formed {p['new_group_s']:.1f} s later")
        if self.resumed_step is not None:
            text += f", resumed from step {self.resumed_step}"
        if self.replica_group is not None and self.rejoined_step is not None:
            left = f" left after step {self.left_after_step} and" if self.left_after_step is not None else ""
            text += (f"; replica group {self.replica_group}{left} rejoined at step {self.rejoined_step} with a live "
                     "group's weights and optimizer state, the other groups training on meanwhile")
        if p["first_step_s"] is not None:
            text += (f", first step done {p['first_step_s']:.1f} s after that: {p['total_s']:.1f} s from the last "
                     "step before the fault to training again")
        return text

    def write(self, run_dir: Path) -> None:
        """Append to ``run_dir/recovery.json`` (a list, oldest first)."""
        path = run_dir / RECOVERY_FILE
        try:
            earlier = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        except (OSError, ValueError):
            earlier = []
        entry = {**asdict(self), **self.phases, "summary": self.describe(),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.noticed))}
        entry.pop("records", None)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps([*earlier, entry], indent=1), encoding="utf-8")
        os.replace(tmp, path)


def read_recoveries(run_dir: Path) -> list[dict[str, Any]]:
    """``recovery.json``'s entries (empty if there is none or it cannot be read)."""
    try:
        data = json.loads((run_dir / RECOVERY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
