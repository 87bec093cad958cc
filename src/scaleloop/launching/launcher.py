"""``scaleloop train`` behind its flags: train in this process, or start N workers under torchrun.

:func:`launch_train` decides. A process started by torchrun or srun is one worker and trains.
In a Ray Train worker it trains there, in Ray's process group (``scaleloop.ray``).
Otherwise it is the launcher: for several processes it checks what it can first (names,
resume), claims the run directory (``scaleloop.checkpoint.claim``), writes the resolved ``config.toml`` and re-launches
``scaleloop train --config`` under torchrun; for one process it trains here.
Torch is imported only when a run starts.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from scaleloop.config import TrainConfig, to_toml
from scaleloop.errors import EXIT_INTERRUPTED, StoppedOnEveryRank, UsageError
from scaleloop.launching.failures import (LOGS_DIR, Failure, leave_unrecorded, quiet_loader_workers,
                                         remove_partial_records, take_unrecorded, usage_error_in_logs)
from scaleloop.launching.supervisor import LaunchOutcome, supervise
from scaleloop.launching.torchrun import WorkerLaunch, launch_for, workers_env
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.ray import in_ray_train_worker, started_by_ray_worker
from scaleloop.runtime import preempt
from scaleloop.runtime.frames import where_of
from scaleloop.runtime.recovery import clear_faults

if TYPE_CHECKING:
    from scaleloop.loop.result import RunResult
    from scaleloop.runtime.dist import DistEnv


class Interrupted(Exception):
    """Ctrl-C (or SIGINT/SIGTERM of the workers); says how to continue if a checkpoint exists."""

    def __init__(self, run_dir: Optional[Path], kept: Optional[str] = "everything written so far is kept") -> None:
        from scaleloop.checkpoint.store import CHECKPOINTS_DIR, list_checkpoints

        # ``kept``: what stays of the interrupted work (None: nothing, as for verify's temporary records).
        text = "interrupted" + (f"; {kept}" if kept else "")
        if run_dir is not None and list_checkpoints(run_dir / CHECKPOINTS_DIR):
            text += f"; continue from the last checkpoint with: scaleloop train --out {run_dir}"
        super().__init__(text)


class WorkersFailed(Exception):
    """The workers started under torchrun failed; the message is the report to print as it is.

    ``failure`` is what ``failure.json`` holds (``scaleloop.launching.failures.Failure``).
    """

    def __init__(self, code: int, failure: Failure) -> None:
        super().__init__("\n".join(failure.report))
        self.code, self.failure = code, failure


def launch_train(cfg: TrainConfig, given: Optional[Mapping[str, Any]] = None) -> Optional["RunResult"]:
    """Train ``cfg``; the result on the process that prints it (rank 0 here), else None.

    ``given``: the flags of the command line as typed (a Kubeflow pod's job must agree with
    them; ``--nproc`` wins over leftover launcher variables).
    None also when this process only launched the workers under torchrun (they print their
    own summary). Raises :class:`Interrupted` on Ctrl-C, :class:`WorkersFailed` when torchrun
    reports a failure, ``UsageError`` for bad settings.
    """
    from scaleloop.checkpoint.resume import run_dir_for
    from scaleloop.launching.jobs import replica_group_in_job, settings_in_job
    from scaleloop.output.rundir import default_run_dir, refuse_if_in_use
    from scaleloop.launching import srun
    from scaleloop.runtime import slurm
    from scaleloop.runtime.cluster import SRUN, read_job

    if in_ray_train_worker():   # called in a Ray Train worker: Ray's process group, reports to Ray
        from scaleloop.ray import train as train_in_ray

        result = train_in_ray(cfg)
        return result if result.run_dir is not None else None
    # Started by torchrun or srun: this process is one worker. Otherwise it is the launcher,
    # which starts torchrun without importing torch: torchrun and its workers are fresh
    # interpreters that import it themselves, as under plain torchrun. In a Kubeflow pod it is
    # one machine's launcher; with leftover RANK/WORLD_SIZE it says so before anything waits.
    job = read_job(os.environ)
    task = slurm.task_from_env(os.environ) if job.kind == SRUN else None
    if task is not None and given and "nproc" in given:   # --nproc wins over an srun task's variables
        print(f"scaleloop: {srun.ignored_line(task, os.environ, given['nproc'])}", flush=True)
        job = read_job({})   # as without the variables: a plain launch on this machine
    here = not job.is_worker
    if here:
        cfg, said = settings_in_job(cfg, job, given or {})
        if said is not None:
            print(f"scaleloop: {said}", flush=True)
            for name in job.leftover_names:   # read by nothing below: this process is no worker of theirs
                os.environ.pop(name, None)
        cfg, said = replica_group_in_job(cfg, os.environ, given or {})
        if said is not None:
            print(f"scaleloop: {said}", flush=True)
        refuse_if_in_use(run_dir_for(cfg))   # the first thing to say about a directory in use
        cfg = auto_processes(cfg)
        if cfg.launch.replica_groups > 1 and cfg.launch.replica_group is None:   # one machine: a lighthouse and N group launchers
            from scaleloop.launching.replica_groups import launch_groups

            failure = launch_groups(cfg)
            if failure is not None:
                raise WorkersFailed(1, failure)
            return None
        if cfg.world_size > 1 or cfg.launch.replica_groups > 1:   # a replica group runs under torchrun, even of one process
            _launch_workers(cfg)
            return None
        # Named now, so that an interrupted run can say where to resume it from.
        out = run_dir_for(cfg) or default_run_dir(cfg.model_data.model, cfg.model_data.data)
        cfg = cfg.replace(out=str(out))

    from scaleloop.loop.training import train
    from scaleloop.runtime import dist

    env = dist.DistEnv.from_env(device=cfg.launch.device, backend=cfg.launch.backend, timeout_s=cfg.launch.timeout)
    check_group_size(cfg, env.world_size)
    if started_by_ray_worker():   # Ray's MASTER_PORT is its parent's: meet in a group of its own
        from scaleloop.ray import join_beside_ray

        join_beside_ray(env)
    elif env.srun_task is not None:
        _meet_srun_tasks(env)
    else:
        dist.init_process_group(env)
    failed = True
    started = time.time()
    try:
        result = train(cfg, env)
        failed = False
    except UsageError as exc:
        if here and cfg.checkpointing.out and isinstance(exc, RunDirWriteError):
            # The loop's own record found no room on a full disk; its lock, released now, leaves some.
            _record_unwritable(Path(cfg.checkpointing.out), str(exc), since=started, where=where_of(exc))
        if env.is_distributed and cfg.checkpointing.out:
            _say_and_leave(exc, Path(cfg.checkpointing.out), env)
        raise
    except KeyboardInterrupt:
        raise Interrupted(Path(cfg.checkpointing.out) if cfg.checkpointing.out and env.is_main else None) from None
    except preempt.Preempted:
        raise
    except Exception as exc:
        if here and cfg.checkpointing.out:  # one process: the same short report as N workers give, not a traceback
            # First: the run is over, and a DataLoader worker that ends now (its handler raises in
            # whatever code runs, an import included) must not break the report.
            quiet_loader_workers()
            raise _failed_here(Path(cfg.checkpointing.out), cfg, exc) from exc
        raise
    finally:
        dist.end_process_group(failed=failed)   # after a failure, maybe once its error is recorded
    return result if env.is_main else None


def check_group_size(cfg: TrainConfig, world_size: int) -> None:
    """Refuse a group smaller than ``--nnodes MIN:MAX`` allows (MIN machines of ``--nproc``).

    torchrun's c10d rendezvous can hand one out: a machine whose heartbeats come late (its agent
    busy or starved for longer than ``keep_alive_interval x keep_alive_max_attempt``) is dropped
    from the round it has just closed, and an agent that reads the round after that starts its workers in
    a group without it, down to one machine. This attempt then ends, before its first collective,
    and torchrun's agents meet again, instead of training on fewer machines than asked."""
    fewest = cfg.launch.min_nnodes * cfg.launch.nproc
    if cfg.launch.elastic and cfg.launch.replica_groups <= 1 and world_size < fewest:
        raise RuntimeError(f"torchrun formed a group of {world_size} process(es), fewer than --nnodes "
                           f"{cfg.launch.elastic_nodes} allows ({cfg.launch.min_nnodes} machine(s) x --nproc "
                           f"{cfg.launch.nproc} = {fewest}): its rendezvous dropped a machine whose heartbeats came "
                           "late; this attempt stops and the machines meet again (a longer --rdzv-conf "
                           "keep_alive_interval x keep_alive_max_attempt avoids it on a loaded machine)")


def _meet_srun_tasks(env: "DistEnv") -> None:
    """An srun task: say what was read, then join the other tasks within ``--timeout``; the wait ends
    in one line (who never came and what to do, or the signal that stopped it)."""
    from scaleloop.launching import srun
    from scaleloop.runtime import dist
    from scaleloop.runtime.srun_rendezvous import MeetTimeout

    task = env.srun_task
    assert task is not None
    try:
        with srun.stops_said(task):   # before the first line: a signal after it is always answered
            print(f"scaleloop: {srun.first_line(task, env.timeout_s)}", flush=True)
            dist.init_process_group(env)
    except MeetTimeout as exc:
        raise srun.gave_up(exc, task) from None
    except KeyboardInterrupt:
        raise Interrupted(None, kept=srun.interrupted_words(task)) from None


def _failed_here(run_dir: Path, cfg: TrainConfig, exc: BaseException) -> Exception:
    """A run in this one process failed: its traceback goes to ``logs/rank-0.log`` and its record to
    ``failure.json``, as a worker's would, and the console gets the short report. Where the run
    directory cannot take them (not a run's, unwritable), the exception itself, traceback and all."""
    import traceback

    from scaleloop.launching.failures import ATTEMPT_MARK, one_process
    from scaleloop.launching.worker import describe_exception
    from scaleloop.output.rundir import is_run_dir, write_atomic

    if run_dir.exists() and not is_run_dir(run_dir):
        return exc   # a failure before the directory was checked: it may hold the user's own files
    try:
        logs = run_dir / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "rank-0.log", "a", encoding="utf-8") as log:
            log.write(f"{ATTEMPT_MARK} one process, pid {os.getpid()} ====\n"
                      + "".join(traceback.format_exception(exc)))
        if not (run_dir / "config.toml").exists():  # a failure at start-up: the retry reuses the directory
            write_atomic(run_dir / "config.toml", to_toml(cfg).encode())
    except OSError:
        return exc
    failure = one_process(run_dir, describe_exception(exc, 0), _continue_line(run_dir))
    failure.write(run_dir)
    return WorkersFailed(1, failure)


def _launch_workers(cfg: TrainConfig) -> None:
    """Start ``cfg.world_size`` workers under torchrun and wait for them."""
    from scaleloop.launching.preflight import preflight
    from scaleloop.checkpoint.resume import run_dir_for
    from scaleloop.checkpoint.claim import claim_run_dir
    from scaleloop.launching.jobs import without_job_variables
    from scaleloop.output.rundir import default_run_dir, write_atomic

    # Check what can be checked before starting N processes, then hand the workers the fully
    # resolved config (run directory included) as a file: every worker and node then trains
    # with exactly the same settings.
    preflight(cfg)
    source = _check_resume(cfg)
    out = run_dir_for(cfg) or default_run_dir(cfg.model_data.model, cfg.model_data.data)
    cfg = cfg.replace(out=str(out))
    # Claimed here for the workers, held while they run (torchrun's restarts too): rank 0 joins it.
    claim = claim_run_dir(out, cfg.model_data.model, cfg.model_data.data, source=source, nnodes=cfg.launch.nnodes)
    run_dir, lock = claim.path, claim.lock
    _take_usage_error(run_dir, [])   # an earlier run's, never this one's
    resolved = run_dir / "config.toml"
    try:
        write_atomic(resolved, to_toml(cfg).encode())
    except RunDirWriteError as exc:
        lock.release()   # a later run is not told the directory is in use; its room takes the record
        error = exc.with_hint(f"once {exc.once}, run the same command again")
        _record_unwritable(run_dir, str(error), since=time.time())
        raise error from None
    logs = run_dir / LOGS_DIR
    clear_faults(logs)   # an earlier launch's: this launch reports only the faults it recovers from
    launch_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"
    # torchrun and every worker count as writers of the run directory while they live, so that
    # its lock is not taken over while one of them still writes (scaleloop.output.lock).
    launch = launch_for(cfg, "scaleloop", ["train", "--config", str(resolved)], logs=logs, launch_id=launch_id,
                        entry="scaleloop.cli",
                        env={**workers_env(cfg, logs, without_job_variables(os.environ)), **claim.workers_env()})
    started = time.time()
    try:
        ended = _run_workers(cfg, launch)
    except KeyboardInterrupt:
        raise _interrupted(run_dir) from None
    finally:
        lock.release()
    code = ended.code
    if code == EXIT_INTERRUPTED or code < 0 or ended.interrupted():
        raise _interrupted(run_dir)
    if code != 0:
        ranks = ended.ranks_logged()
        # Several machines may share the run directory (a Kubeflow job's claim): each launcher takes
        # only its own workers' files where it knows them, so that rank 0's stays for its machine.
        here = _machine_ranks(cfg)
        local = ranks if here is None else here
        said = _take_usage_error(run_dir, local, only=here)
        if said is None or not said[0]:
            # Where the machines are numbered by a rendezvous, another launcher may have taken this
            # machine's files: the ranks' logs still say it.
            found = usage_error_in_logs(run_dir, local)
            said = (found[1], bool(said and said[1])) if found is not None else said
        # What the workers could not write for want of room (their records, their messages); their
        # half-written records go (the workers have ended: none is still being written).
        unrecorded = take_unrecorded(logs, only=here)
        remove_partial_records([ended.launch.error_dir,
                                *(p for r in local for p in logs.glob(f"fault-rank-{r}.json.tmp-*"))])
        # An empty message: a rank's usage error found no room in its file.
        if unrecorded or (said is not None and (not said[0] or said[0].startswith(UNWRITABLE_START))):
            # The run directory's disk is full (or read-only): one line, exit 2, as when rank 0's own
            # loop finds it so, not "no Python error" for the ranks whose words found no room.
            line = said[0] if said is not None and said[0] else _unrecorded_line(run_dir, unrecorded)
            _record_unwritable(run_dir, line, since=started)
            error = RunDirWriteError(line)
            error.shown = said is not None and said[1]
            raise error
        if said is not None:  # a worker found bad input (the user's model or data): said in one line, once
            _record_usage_error(run_dir, said[0], since=started)
            error = UsageError(said[0])
            error.shown = said[1]
            raise error
        failure = ended.failure(run_dir, continue_line=_continue_line(run_dir), timeout_s=cfg.launch.timeout, ranks=ranks)
        failure.write(run_dir)
        raise WorkersFailed(code, failure)


# How every line of a RunDirWriteError starts (``scaleloop.output.rundir.unwritable``).
UNWRITABLE_START = "cannot write '"


def _unrecorded_line(run_dir: Path, unrecorded: dict[int, str]) -> str:
    """The one line for ranks that stopped on a disk that took none of their words (``unrecorded``:
    rank -> the errno's name): the disk, its free space now, and how to go on."""
    import errno
    import shutil

    from scaleloop.output.unwritable import size_text, unwritable   # the sizes as unwritable() words them

    number = getattr(errno, next(iter(unrecorded.values()), "ENOSPC"), errno.ENOSPC)
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    ranks = sorted(unrecorded)
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}") if ranks else "the ranks"
    exc = unwritable(run_dir / LOGS_DIR, OSError(number, os.strerror(number)))
    room = f" ({size_text(free)} free now)" if free is not None else ""
    once = "space is freed" if number in (errno.ENOSPC, errno.EDQUOT) else "the run directory is writable again"
    their = "its" if len(ranks) == 1 else "their"
    return (f"{exc}{room}: {who} stopped, and {their} record of why found no room; "
            + _continue_line(run_dir).replace("once fixed", f"once {once}"))


def _record_unwritable(run_dir: Path, message: str, since: float,
                       where: Optional[Mapping[str, Any]] = None) -> None:
    """``failure.json`` for a run directory that could not be written, for ``scaleloop doctor``,
    unless rank 0's loop recorded it since ``since`` (its record has the epoch and step)."""
    from scaleloop.output.endings import FAILURE_FILE

    try:
        recorded_now = (run_dir / FAILURE_FILE).stat().st_mtime >= since
    except OSError:
        recorded_now = False
    if not recorded_now:
        where = where or {}
        Failure("unwritable", epoch=where.get("epoch"), step=where.get("step"), during=where.get("during"),
                error_type="RunDirWriteError", message=message, report=[f"scaleloop: error: {message}"]).write(run_dir)


def _machine_ranks(cfg: TrainConfig) -> Optional[list[int]]:
    """The global ranks of this machine's workers where the machines are numbered (``--node-rank``
    with ``--master-addr``, as in a Kubeflow pod); None on one machine, or where a rendezvous
    numbers them."""
    if cfg.launch.nnodes > 1 and not cfg.launch.rdzv_endpoint:
        return list(range(cfg.launch.node_rank * cfg.launch.nproc, (cfg.launch.node_rank + 1) * cfg.launch.nproc))
    return None


def _record_usage_error(run_dir: Path, message: str, since: float) -> None:
    """``failure.json`` for the workers' bad input, for ``scaleloop doctor``, unless a rank's loop
    recorded how this launch ended already (with its kind, rank, epoch and step: ``loop.pauses``;
    a divergence is one): that record, written since ``since``, says more than this one."""
    from scaleloop.output.endings import FAILURE_FILE

    try:
        recorded_now = (run_dir / FAILURE_FILE).stat().st_mtime >= since
    except OSError:
        recorded_now = False
    if not recorded_now:   # one found while starting up (building the model), before any loop
        Failure("usage", error_type="UsageError", message=message, report=[f"scaleloop: error: {message}"]).write(run_dir)


def _run_workers(cfg: TrainConfig, launch: WorkerLaunch) -> LaunchOutcome:
    """Print the plain torchrun command, run the workers supervised and wait for them.

    A stop signal (SIGTERM, SIGUSR1, --signal) is passed on: the workers checkpoint and end, and
    :class:`Preempted` says where the run stopped and how to continue.
    """
    print(f"scaleloop: launching {cfg.launch.nproc} process(es) x {cfg.launch.nnodes} node(s) with torchrun:\n  "
          + " ".join(shlex.quote(c) for c in launch.plain_command()), flush=True)
    ended = supervise(launch, forward=preempt.stop_signals(cfg.launch.signal, torchrun_worker=False, slurm=False))
    if preempt.requested() is not None and ended.code != 0:  # 0: the run ended before the signal
        line = _stopped_line(cfg, launch.logs.parent)
        # Rank 0 recorded the stop already, but names the signal torchrun passed on (SIGUSR1):
        # the record says what the launcher received.
        Failure("stopped", message=line, report=[f"scaleloop: {line}"]).write(launch.logs.parent)
        raise preempt.Preempted(line)
    return ended


def _stopped_line(cfg: TrainConfig, run_dir: Path) -> str:
    """What the launcher says after a stop signal: the newest checkpoint and how to continue."""
    from scaleloop.checkpoint.store import CHECKPOINTS_DIR, newest_valid

    received = preempt.signal_name(preempt.requested() or signal.SIGTERM)
    found = newest_valid(run_dir / CHECKPOINTS_DIR, warn=lambda _msg: None)
    if found is None:
        return f"stopped by {received}; no checkpoint was written: a new run starts over"
    where = " (on every machine, with its own --node-rank)" if cfg.launch.nnodes > 1 else ""
    return (f"stopped by {received} after step {found.step}; checkpoint {found.path} written; "
            f"continue with: {preempt.continue_command(str(run_dir))}{where}")


def _interrupted(run_dir: Path) -> Interrupted:
    """The interruption, also recorded in ``failure.json`` for ``scaleloop doctor``."""
    exc = Interrupted(run_dir)
    Failure("interrupted", message="Ctrl-C (SIGINT) or SIGTERM", report=[f"scaleloop: {exc}"]).write(run_dir)
    return exc


def _continue_line(run_dir: Path) -> str:
    """The report's last line: how to go on once the cause is fixed."""
    from scaleloop.checkpoint.store import CHECKPOINTS_DIR, list_checkpoints
    from scaleloop.launching.replica_groups import CONTINUE_VAR

    from scaleloop.output.rundir import never_stepped

    job = os.environ.get(CONTINUE_VAR)
    if job:   # a replica group of a job on one machine: its lighthouse went with the job's launcher
        return f"once fixed, continue the whole job (every replica group) with: {job}"

    if list_checkpoints(run_dir / CHECKPOINTS_DIR):
        return f"once fixed, continue from the last checkpoint with: scaleloop train --out {shlex.quote(str(run_dir))}"
    if never_stepped(run_dir):  # the retry may reuse the directory (output.rundir.prepare_run_dir)
        return (f"nothing was kept (no checkpoint, no logged step); once fixed, run the same command again: "
                f"it starts over in {run_dir}")
    config = shlex.quote(str(run_dir / "config.toml"))
    return (f"no checkpoint was written; once fixed, start over with: scaleloop train --config {config} "
            f"--out {shlex.quote(str(run_dir) + '-2')}")


# A worker that stops on bad input leaves its one-line message here for the launcher
# (usage-error-rank-<R>.txt): rank 0 has printed it already, any other rank's is only in its log.
USAGE_ERROR_PREFIX = "usage-error-rank-"


@contextlib.contextmanager
def _termination_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block ends, then arrive as usual. (A signal mask would not
    do: the kernel hands a process's signal to any thread that does not block it.)"""
    if threading.current_thread() is not threading.main_thread():   # a Ray worker's thread
        yield
        return
    arrived: list[int] = []
    held = (signal.SIGTERM, signal.SIGINT)
    before = {sig: signal.signal(sig, lambda sig, _frame: arrived.append(sig)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for sig in dict.fromkeys(arrived):
            signal.raise_signal(sig)


def _say_and_leave(exc: UsageError, run_dir: Path, env: DistEnv) -> None:
    """A worker's usage error: said on rank 0 (whose console is the launcher's: said once, and the
    launcher then stays quiet) and left in ``run_dir`` for the launcher on every rank.

    torchrun ends the other ranks as soon as one has exited: held off until this rank's message is
    both said and left. An ending that every rank raises alike (:class:`StoppedOnEveryRank`) waits,
    on every rank, until rank 0 has recorded it (failure.json, in the loop) and said it.
    """
    with _termination_held():
        if env.is_main:
            print(f"scaleloop: error: {exc}", file=sys.stderr, flush=True)
            exc.shown = True
        _leave_usage_error(run_dir, env.rank, str(exc))
    if isinstance(exc, StoppedOnEveryRank):
        _meet_before_exit(env)


def _meet_before_exit(env: DistEnv) -> None:
    """A barrier of the run's ranks; a group already broken (a rank gone) lets this one exit."""
    from scaleloop.runtime.collectives import barrier

    try:
        barrier(env)
    except Exception:   # noqa: BLE001 - the rank's own error is what it reports
        pass


def _leave_usage_error(run_dir: Path, rank: int, message: str) -> None:
    path = run_dir / f"{USAGE_ERROR_PREFIX}{rank}.txt"
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message)
    except OSError as exc:
        # This node does not see the run directory, or its disk is full: an empty file (a name takes
        # no room) still says that this rank stopped on a message, which rank 0 has shown.
        try:
            path.open("w").close()
        except OSError:
            pass
        leave_unrecorded(run_dir / LOGS_DIR, rank, exc)


def _take_usage_error(run_dir: Path, local_ranks: list[int],
                      only: Optional[list[int]] = None) -> Optional[tuple[str, bool]]:
    """The workers' usage error (rank 0's first, else the lowest rank's), and whether it was shown on
    this console already (rank 0 runs here and said it); the files are removed (``only``: those of
    these ranks, the others' are another machine's)."""
    said: dict[int, str] = {}
    for path in run_dir.glob(f"{USAGE_ERROR_PREFIX}*.txt"):
        try:
            rank = int(path.stem[len(USAGE_ERROR_PREFIX):])
            if only is not None and rank not in only:
                continue
            said[rank] = path.read_text(encoding="utf-8").strip()
            path.unlink()
        except (OSError, ValueError):
            continue
    if not said:
        return None
    # An empty file: the rank's message found no room on the disk; rank 0 showed its own all the
    # same (it prints first). None is known: ("", shown).
    shown = 0 in said and 0 in local_ranks
    said = {rank: message for rank, message in said.items() if message}
    return (said[min(said)], shown) if said else ("", shown)


def _check_resume(cfg: TrainConfig) -> Optional[Path]:
    """Before starting workers: the checkpoint to resume (None: a fresh start), checked against ``cfg``."""
    from scaleloop.checkpoint.resume import check_compatible, find_checkpoint

    info = find_checkpoint(cfg, restarting=False, warn=lambda msg: print(f"scaleloop: {msg}", file=sys.stderr))
    if info is None:
        return None
    if isinstance(info.meta.get("config"), dict):
        check_compatible(info.meta["config"], cfg.flat(), str(info.path))
    return info.path


def auto_processes(cfg: TrainConfig) -> TrainConfig:
    """``--strategy auto`` on a machine with several GPUs: one DDP process per GPU."""
    if cfg.parallel.strategy != "auto" or cfg.world_size > 1 or cfg.launch.device not in ("auto", "cuda"):
        return cfg
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cfg.replace(nproc=gpus, strategy="ddp") if gpus > 1 else cfg
