"""``scaleloop doctor RUN_DIR``: read a run directory and say what happened, in a few lines.

It reads only what a run leaves behind, so it works after any ending, on any machine that sees
the directory, without torch:

- ``model.pt``: written last, when a run finishes (after its final checkpoint); on a job whose
  machines do not share the run directory, each machine's directory gets a copy of it, as of every
  checkpoint (``scaleloop.checkpoint.replicas``), but only rank 0's has ``metrics.csv``;
- ``failure.json``: every ending but a finished run's (``scaleloop.output.endings``): workers
  that failed, stalled or were interrupted, a non-finite loss, a stop signal, a full disk, bad
  input (``docs/troubleshooting.md`` lists its keys);
- ``metrics.csv``: the steps and epochs that were logged;
- ``checkpoints/``: the newest checkpoint whose manifest and checksums verify;
- ``config.toml``: the run's settings, which ``scaleloop train --out RUN_DIR`` resumes with;
- ``recovery.json``: the faults an elastic job got over, and how long each took (listed as they are);
- ``profile/summary.json``: a ``--profile`` run's summary, printed again after the report;
- ``scaleloop.lock``: held while a run writes there (``scaleloop.output.lock``). A lock whose
  process lives (the same process: its start time matches the lock's) is a run in progress,
  told as such and never given a continue command.

A replica-groups job's directory (``scaleloop train --replica-groups N --out DIR``: ``DIR/group-I``
for each group, ``DIR/lighthouse.log``) is told group by group (:func:`diagnose_groups`): each
group's story as above, then how the job continues.

Otherwise, which of them is newest decides the story: a ``model.pt`` newer than every checkpoint and
failure record is a finished run; a failure record newer than ``model.pt`` is a failed,
stalled or interrupted one; neither is a run that stopped without a word (killed, or its
machine lost).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from scaleloop.checkpoint.store import CHECKPOINTS_DIR, CheckpointInfo, newest_valid
from scaleloop.config import load_toml
from scaleloop.errors import UsageError
from scaleloop.launching.failures import AGENT_LOG, LOGS_DIR
from scaleloop.output.lock import LOCK_FILE, Holder, live_holder
from scaleloop.runtime.recovery import read_recoveries

FAILURE_FILE = "failure.json"
MODEL_FILE = "model.pt"
METRICS_FILE = "metrics.csv"
CONFIG_FILE = "config.toml"


@dataclass(frozen=True)
class Diagnosis:
    """What a run directory says about its run."""

    run_dir: Path
    state: str                      # running | finished | failed | stalled | interrupted | stopped | diverged | unwritable | not started
    what: str                       # one line: what happened
    details: tuple[str, ...] = ()   # a few more lines: where, logs, hints
    checkpoint: Optional[CheckpointInfo] = None
    continue_with: Optional[str] = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    recoveries: tuple[str, ...] = ()   # faults an elastic job got over (recovery.json), oldest first

    def lines(self) -> list[str]:
        """The report, as printed."""
        out = [f"run: {self.run_dir}", f"what happened: {self.what}"]
        out += [f"  {d}" for d in self.details]
        out += [f"  {r}" for r in self.recoveries]
        out += [f"  {w}" for w in self.warnings]
        if self.checkpoint is not None:
            meta = self.checkpoint.meta
            where = f"step {self.checkpoint.step}"
            epoch, in_epoch = meta.get("epoch"), meta.get("step_in_epoch")
            if isinstance(epoch, int) and isinstance(in_epoch, int):
                # The manifest holds where the next run starts: epoch is 0-based.
                where += f": epoch {epoch + 1}, step {in_epoch}" if in_epoch else f": the end of epoch {epoch}"
            out.append(f"newest valid checkpoint: {self.checkpoint.path} ({where})")
        else:
            out.append("newest valid checkpoint: none")
        if self.state == "running":
            out.append("to continue: nothing to continue: the run is still going")
        else:
            out.append(f"to continue: {self.continue_with}" if self.continue_with else "to continue: nothing to continue")
        return out


def diagnose(run_dir: Path) -> Diagnosis:
    """Read ``run_dir`` and tell its story (module doc); UsageError if it is not a run directory."""
    told = _diagnose(run_dir)
    entries = read_recoveries(run_dir)
    if not entries:
        return told
    recoveries = tuple(f"{e.get('when', '?')}: {e.get('summary', '')}" for e in entries[-5:])
    # A run that torchrun restarted says so in its first line too: a rank died on the way.
    got_over = f"; on the way torchrun restarted its workers {len(entries)} time(s) after a fault (below)"
    return dataclasses.replace(told, what=told.what + got_over, recoveries=recoveries)


def _diagnose(run_dir: Path) -> Diagnosis:
    if not run_dir.is_dir():
        raise UsageError(f"{str(run_dir)!r} is not a directory; give the run directory (the --out of a run, "
                         "e.g. runs/20261125-101500-simplenet-digits)")
    ckpt_root = run_dir / CHECKPOINTS_DIR
    if not any((run_dir / name).exists() for name in (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR, FAILURE_FILE)):
        raise UsageError(f"{str(run_dir)!r} is not a scaleloop run directory (no {CONFIG_FILE}, {METRICS_FILE}, "
                         f"{CHECKPOINTS_DIR}/ or {FAILURE_FILE}); give the --out of a run")
    warnings: list[str] = []
    checkpoint = newest_valid(ckpt_root, warnings.append)
    config = _config(run_dir, warnings)
    rows = _metrics(run_dir / METRICS_FILE)
    holder = live_holder(run_dir)
    if holder is not None:   # a run writes here now: what an earlier attempt left is not its story
        return Diagnosis(run_dir, "running", _running(run_dir, holder, rows, checkpoint, config), checkpoint=checkpoint,
                         warnings=tuple(warnings))
    failure = _failure(run_dir / FAILURE_FILE, warnings)
    resume = _continue_command(run_dir, checkpoint, config)

    model_t = _mtime(run_dir / MODEL_FILE)
    newest_other = max(_mtime(checkpoint.path) if checkpoint else 0.0, _mtime(run_dir / FAILURE_FILE))
    if model_t and model_t >= newest_other:
        return Diagnosis(run_dir, "finished", _finished(rows, config, checkpoint), _copy_note(run_dir, config),
                         checkpoint=checkpoint, continue_with=_extend_command(run_dir, config),
                         warnings=tuple(warnings))
    if failure is not None:
        state, what, details = _from_failure(failure, run_dir, config)
        return Diagnosis(run_dir, state, what, details, checkpoint, resume, tuple(warnings))
    last = _last_step(rows)
    if last is None and checkpoint is None:
        return Diagnosis(run_dir, "not started", "no step was logged and no checkpoint was written: the run "
                         "stopped before its first log row (or is starting now)", checkpoint=None,
                         continue_with=_restart_command(run_dir), warnings=tuple(warnings))
    step = max(last or 0, checkpoint.step if checkpoint else 0)
    return Diagnosis(run_dir, "stopped",
                     f"stopped after step {step} without finishing and left no failure record: it was "
                     "killed (Ctrl-C, SIGKILL, out of memory) or its machine was lost", (),
                     checkpoint, resume, tuple(warnings))


def _running(run_dir: Path, holder: Holder, rows: list[dict[str, str]], checkpoint: Optional[CheckpointInfo],
             config: dict[str, Any]) -> str:
    """"running (pid P, N ranks, step S)", and where the lock cannot be checked, what to do if it is stale."""
    ranks = (_int(config.get("nproc")) or 1) * (_int(config.get("nnodes")) or 1)
    step = max(_last_step(rows) or 0, checkpoint.step if checkpoint else 0)
    where = f"step {step}" if step else "no step logged yet"
    text = f"running (pid {holder.pid}, {ranks} rank{'s' if ranks > 1 else ''}, {where})"
    if holder.host != socket.gethostname():
        text += (f" on {holder.host}, as its lock says (not checkable from here; if that run is gone, "
                 f"delete {run_dir / LOCK_FILE})")
    return text


def format_diagnosis(d: Diagnosis) -> str:
    """The report as one string."""
    return "\n".join(d.lines())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _config(run_dir: Path, warnings: list[str]) -> dict[str, Any]:
    if not (run_dir / CONFIG_FILE).is_file():
        return {}
    try:
        return load_toml(run_dir / CONFIG_FILE)
    except UsageError as exc:
        warnings.append(f"warning: {exc}")
        return {}


def _metrics(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    except (OSError, csv.Error, UnicodeDecodeError):
        return []


def _failure(path: Path, warnings: list[str]) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        warnings.append(f"warning: {path} cannot be read ({exc}); the story below ignores it")
        return None
    return data if isinstance(data, dict) else None


def _int(value: Any) -> Optional[int]:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def _last_step(rows: list[dict[str, str]]) -> Optional[int]:
    steps = [s for s in (_int(r.get("step")) for r in rows) if s is not None]
    return max(steps) if steps else None


def _finished(rows: list[dict[str, str]], config: dict[str, Any], checkpoint: Optional[CheckpointInfo]) -> str:
    epochs = [r for r in rows if r.get("kind") in ("epoch", "stop")]   # stop: --max-steps inside an epoch
    # No rows: another machine's copy of the run (its final checkpoint is the run's last step).
    steps = _last_step(rows) if rows else (checkpoint.step if checkpoint is not None else None)
    text = "finished"
    if epochs:
        last = epochs[-1]
        text += f": {last.get('epoch')} epoch(s), {steps} step(s)"
        if last.get("train_loss"):
            text += f", train loss {float(last['train_loss']):.4f}"
        if last.get("test_loss"):
            text += f", test loss {float(last['test_loss']):.4f}"
        if last.get("test_acc"):
            text += f", test accuracy {float(last['test_acc']):.2%}"
    elif steps is not None:
        text += f" after {steps} step(s)"
    return text


def _copy_note(run_dir: Path, config: dict[str, Any]) -> tuple[str, ...]:
    """For a machine's own copy of a several-machine run (no ``metrics.csv``: rank 0 writes it, on
    its machine): where the rest of the story is."""
    if (_int(config.get("nnodes")) or 1) > 1 and not (run_dir / METRICS_FILE).exists():
        return ("this is one machine's copy of the run (its machines do not share the run directory): its "
                "metrics and summary are in rank 0's run directory, on that machine",)
    return ()


def _where(failure: dict[str, Any]) -> str:
    during = failure.get("during")
    if isinstance(during, str) and during:   # not a training step (as the launcher's report says it)
        return f" in {during}" if during.startswith("the ") else f" while {during}"
    parts = []
    if failure.get("epoch") is not None:
        parts.append(f"epoch {failure['epoch']}")
    if failure.get("step") is not None:
        parts.append(f"step {failure['step']}")
    return f" at {', '.join(parts)}" if parts else ""


def _from_failure(failure: dict[str, Any], run_dir: Path, config: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """state, the line saying what happened, and detail lines, from a launcher's failure record."""
    kind = str(failure.get("kind") or "failed")
    rank = failure.get("rank")
    who = f"rank {rank}" if rank is not None else "a worker"
    error = ": ".join(str(p) for p in (failure.get("error_type"), failure.get("message")) if p)
    details: list[str] = []
    if kind == "stalled":
        what = f"stalled: {who} stopped taking part{_where(failure)}"
        if failure.get("frame"):
            what += f", stuck at {failure['frame']}"
        if failure.get("waiting_in"):
            details.append(f"the other ranks waited in {failure['waiting_in']}")
        details.append("if that rank was only slow (a long first compile, a big checkpoint), raise --timeout "
                       f"(this run: {config.get('timeout', 'the default')} s)")
    elif kind == "interrupted":
        what = f"interrupted{_where(failure)}" + (f" ({failure.get('message')})" if failure.get("message") else "")
    elif kind == "diverged":   # the loop's own record: the first non-finite loss, its step and rank
        what = f"diverged: {failure.get('message') or 'the loss stopped being finite'}"
        details.append("continue from the newest checkpoint with --clip-grad 1.0, or start over with a lower --lr")
    elif kind == "stopped":    # a stop signal: the loop checkpointed and ended as asked
        what = str(failure.get("message") or "stopped by a signal")
    elif kind == "unwritable":
        what = f"stopped{_where(failure)}: {failure.get('message')}"
    elif kind == "usage":
        what = f"stopped on bad input{_where(failure)}: {failure.get('message')}"
        kind = "failed"
    else:
        kind = "failed"
        # "with ValueError: ..." for an exception; ": was killed by SIGKILL" for a rank that raised nothing.
        joint = " with " if failure.get("error_type") else ": "
        if rank is None and not failure.get("error_type") and error:   # torchrun's own failure, no worker's
            what = f"failed{_where(failure)}: {error}"
        else:
            what = f"failed on {who}{_where(failure)}" + (f"{joint}{error}" if error else "")
        if failure.get("frame"):
            details.append(f"raised at {failure['frame']}")
    logs = failure.get("logs")
    if isinstance(logs, dict) and logs:
        key = str(rank) if str(rank) in logs else sorted(logs)[0]
        log = Path(str(logs[key]))
        details.append(f"log of rank {key}: {log if log.is_absolute() else run_dir / log}"
                       + (f" (all ranks: {len(logs)} logs beside it)" if len(logs) > 1 else ""))
    elif kind == "failed" and rank is None and (run_dir / LOGS_DIR / AGENT_LOG).is_file():
        # No worker wrote a log (torchrun failed before starting them): its own are all there is.
        details.append(f"torchrun's messages: {run_dir / LOGS_DIR / AGENT_LOG}")
    if failure.get("time"):
        details.append(f"recorded {failure['time']}")
    return kind, what, tuple(details)


def _continue_command(run_dir: Path, checkpoint: Optional[CheckpointInfo], config: dict[str, Any]) -> str:
    if checkpoint is None:
        return _restart_command(run_dir)
    cmd = f"scaleloop train --out {shlex.quote(str(run_dir))}"
    nodes = _int(config.get("nnodes")) or 1
    if nodes > 1:
        cmd += f"   (on each of the {nodes} nodes, with its --node-rank)"
    return cmd


def _restart_command(run_dir: Path) -> str:
    """No checkpoint: the run starts over, with its settings, in a new directory."""
    from scaleloop.output.rundir import never_stepped

    config = run_dir / CONFIG_FILE
    if never_stepped(run_dir):  # the corrected command may reuse the directory
        return "nothing was kept (no checkpoint, no logged step): run the same command again, once fixed"
    new = shlex.quote(str(run_dir) + "-2")
    if config.is_file():
        return f"no checkpoint to continue from; start over: scaleloop train --config {shlex.quote(str(config))} --out {new}"
    return f"no checkpoint to continue from; start over: scaleloop train --out {new}"


def _extend_command(run_dir: Path, config: dict[str, Any]) -> str:
    epochs, max_steps = _int(config.get("epochs")), _int(config.get("max_steps"))
    if max_steps:
        more = f" --max-steps {2 * max_steps}"   # the limit that stopped it, raised
    else:
        more = f" --epochs {epochs + 1}" if epochs else " --epochs N"
    nodes = _int(config.get("nnodes")) or 1
    where = f"   (on each of the {nodes} nodes, with its --node-rank)" if nodes > 1 else ""
    return f"nothing left to train; to train further: scaleloop train --out {shlex.quote(str(run_dir))}{more}{where}"


def register(subparsers: Any) -> None:
    """Add ``doctor RUN_DIR`` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "doctor", help="read a run directory: what happened, the newest checkpoint, how to continue",
        description="Read a run directory (the --out of a run) and say in a few lines whether the run "
                    "finished, was interrupted, failed (which rank, with what, where) or stalled (which "
                    "rank, stuck where), the newest checkpoint that verifies, and the command that continues it.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (e.g. runs/20261125-101500-simplenet-digits)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.run_dir)
    if replica_group_dirs(path):
        print("\n".join(diagnose_groups(path)))
        return 0
    print(format_diagnosis(diagnose(path)))
    _print_profile(path)
    return 0


# --- a replica-groups job (--replica-groups N) ---------------------------------------------
def replica_group_dirs(job_dir: Path) -> list[Path]:
    """The run directories of a replica-groups job's groups, by index (``group-0``, ``group-1``...);
    empty when ``job_dir`` is a run directory itself or holds no group's."""
    from scaleloop.launching.replica_groups import GROUP_PREFIX

    if not job_dir.is_dir() or any((job_dir / name).exists() for name in (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR)):
        return []
    found = [d for d in job_dir.glob(f"{GROUP_PREFIX}*") if d.is_dir() and d.name[len(GROUP_PREFIX):].isdigit()]
    return sorted(found, key=lambda d: int(d.name[len(GROUP_PREFIX):]))


def diagnose_groups(job_dir: Path) -> list[str]:
    """The report of a replica-groups job: each group's story (what happened, the faults it got over,
    its newest checkpoint), then how the job continues."""
    from scaleloop.launching.replica_groups import LIGHTHOUSE_LOG

    groups = replica_group_dirs(job_dir)
    told: list[Diagnosis] = []
    lines = [f"replica groups: {job_dir} ({len(groups)} groups)"]
    for group in groups:
        try:
            d = diagnose(group)
        except UsageError as exc:   # a group that never wrote anything (it did not start)
            lines.append(f"{group.name}: {exc}")
            continue
        told.append(d)
        lines.append(f"{group.name}: {d.what}")
        lines += [f"  {line}" for line in (*d.details, *d.recoveries, *d.warnings)]
        lines.append(f"  newest valid checkpoint: {_checkpoint_line(d.checkpoint)}")
    if (job_dir / LIGHTHOUSE_LOG).is_file():
        lines.append(f"the lighthouse's messages: {job_dir / LIGHTHOUSE_LOG}")
    lines.append(f"to continue: {_continue_groups(job_dir, groups, told)}")
    return lines


def _checkpoint_line(checkpoint: Optional[CheckpointInfo]) -> str:
    return f"{checkpoint.path} (step {checkpoint.step})" if checkpoint is not None else "none"


def _continue_groups(job_dir: Path, groups: list[Path], told: list[Diagnosis]) -> str:
    """The command that continues the job: the one-machine command again (its groups' newest
    checkpoints), or each group's own where they were started one by one (no lighthouse.log here)."""
    from scaleloop.launching.replica_groups import LIGHTHOUSE_LOG

    if any(d.state == "running" for d in told):
        return "nothing to continue: a group is still running"
    if told and len(told) == len(groups) and all(d.state == "finished" for d in told):
        return "nothing left to train"
    if not (job_dir / LIGHTHOUSE_LOG).is_file():
        return ("each group's own command again, on its machine, with the same --out (its newest checkpoint; a "
                "group behind the others takes a live group's state)")
    per_group = max((_int(_config(g, []).get("nproc")) or 1 for g in groups), default=1)
    return (f"scaleloop train --replica-groups {len(groups)} --nproc {per_group * len(groups)} "
            f"--out {shlex.quote(str(job_dir))}")


def _print_profile(run_dir: Path) -> None:
    """The summary of a ``--profile`` run (``profile/summary.json``), as the run printed it."""
    from scaleloop.output import profile_summary   # (here: a run without --profile never loads it)
    summary = profile_summary.read(run_dir)
    if summary is not None:
        print("\n".join(profile_summary.lines(summary, run_dir / profile_summary.PROFILE_DIR)))
