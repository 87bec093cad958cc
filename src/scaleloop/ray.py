"""Ray Train as a home for scaleloop: train inside a ``TorchTrainer``'s workers, with Ray's
process group, and hand each checkpoint and its metrics to Ray (docs/ray.md).

Two forms, one path:

- the library: :func:`train` called in the train function (``scaleloop.ray.train(cfg)``);
- the CLI: ``scaleloop.cli.main(["train", ...])`` called there; the launcher sees
  :func:`in_ray_train_worker` and comes here.

Both resume from Ray's checkpoint (``ray.train.get_checkpoint()``) when Ray restarts the job,
keep a log per rank (``<run>/logs/rank-<R>.log``) and report with ``ray.train.report``.
A ``scaleloop train`` started as a *child process* of a Ray worker (:func:`started_by_ray_worker`)
trains in its own process group, which meets in Ray's store under its own prefix
(:func:`join_beside_ray`), never on Ray's ``MASTER_PORT``; Ray gets nothing from it.

This module imports neither torch nor ray at its top: the launcher asks it where it runs first.
``--timeout``: Ray makes the default process group before scaleloop runs, with
``TorchConfig(timeout_s=...)``; that value bounds its collectives, and ``--timeout`` the
groups a strategy makes beside it (docs/ray.md).
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, TextIO

from scaleloop.runtime.cluster import in_ray_group

if TYPE_CHECKING:
    from scaleloop.config import TrainConfig
    from scaleloop.data.loader import Batch
    from scaleloop.loop.result import RunResult
    from scaleloop.runtime.dist import DistEnv

__all__ = ["train", "in_ray_train_worker", "started_by_ray_worker", "join_beside_ray", "metrics_of", "HandOff", "printed_once"]

# What Ray sets in each worker process, and what its children inherit: the raylet's pid and
# torchrun's variables for the process group Ray has made (ray/train/torch/config.py); read by
# runtime.cluster.in_ray_group. Whether Ray Train is loaded tells the worker from its children.


def in_ray_train_worker(environ: Optional[Mapping[str, str]] = None,
                        modules: Optional[Mapping[str, Any]] = None) -> bool:
    """True in the process of a Ray Train worker (where a ``TorchTrainer``'s train function runs):
    Ray's variables are set and Ray Train is loaded in this process."""
    env = os.environ if environ is None else environ
    return in_ray_group(env) and "ray.train" in (sys.modules if modules is None else modules)


def started_by_ray_worker(environ: Optional[Mapping[str, str]] = None,
                          modules: Optional[Mapping[str, Any]] = None) -> bool:
    """True in a process that a Ray Train worker started (``subprocess.run(["scaleloop", "train", ...])``):
    it inherited Ray's variables, but Ray's process group and its ``MASTER_PORT`` are its parent's."""
    env = os.environ if environ is None else environ
    return in_ray_group(env) and "ray.train" not in (sys.modules if modules is None else modules)


def train(cfg: "TrainConfig", *, log: Optional[Callable[[str], None]] = None,
          on_batch: Optional[Callable[["Batch"], None]] = None) -> "RunResult":
    """Train ``cfg`` in this Ray Train worker; call it on every worker, in the train function.

    - Ray's process group is used as it is (ranks and world size are Ray's; scaleloop neither
      makes nor ends it).
    - When Ray restarted the job, the run continues from Ray's checkpoint
      (``ray.train.get_checkpoint()``), copied into ``<out>/checkpoints/step-N``: bitwise the
      run that was not stopped. (Ray's checkpoint is the latest the job reported: one of an
      earlier run in the same train function, written in another ``--out``, is not resumed.)
    - Each checkpoint is reported with ``ray.train.report(metrics, checkpoint)`` as it is written
      (rank 0 gives the directory, Ray copies it to its storage), and the run's summary once at the
      end; the metrics are :func:`metrics_of`.
    - Each rank logs to ``<out>/logs/rank-<R>.log`` besides its console (Ray's worker log).

    ``--out`` names the run directory (rank 0's default name otherwise); with ``fsdp`` it must be a
    directory every worker sees, as on several machines. Returns the run's result on every rank.
    """
    import ray.train

    from scaleloop.loop.training import train as train_run
    from scaleloop.runtime import dist
    from scaleloop.runtime.collectives import broadcast_object

    env = dist.DistEnv.from_env(device=cfg.launch.device, backend=cfg.launch.backend, timeout_s=cfg.launch.timeout)
    dist.init_process_group(env)   # Ray's group is there already: nothing to do (one worker: none needed)
    # Rank 0 decides where the run goes and what it continues from; the others take its word
    # (or its error: raised on every rank alike, none is left waiting).
    decided: Any = None
    if env.is_main:
        try:
            decided = _continue_from_ray(cfg, ray.train.get_checkpoint())
        except Exception as exc:
            decided = exc
    decided = broadcast_object(decided, env)
    if isinstance(decided, Exception):
        raise decided
    out, resume, note = decided
    cfg = cfg.replace(out=out, resume=resume)
    with _rank_log(Path(out), env.rank) as rank_log:
        if env.is_main:
            (log or print)(f"scaleloop: in a Ray Train worker: rank 0 of {env.world_size}, in Ray's process group "
                           f"({env.backend or 'one process'}); checkpoints and metrics go to Ray (ray.train.report)"
                           + (f"\n{note}" if note else ""))
        hand_off = HandOff(env)
        result = train_run(cfg, env, log=log, on_batch=on_batch, on_checkpoint=hand_off.written)
        hand_off.finish()   # the newest checkpoint, if it was held back
        ray.train.report(metrics_of(result))   # the summary; result.checkpoint stays the last one reported
        if env.is_main:
            from scaleloop.loop.text import format_result

            (log or print)(hand_off.line(result))
            # Into the log only: the console's summary is the caller's to print (the CLI does).
            rank_log.write(format_result(result) + "\n")
    return result


def _continue_from_ray(cfg: "TrainConfig", saved: Any) -> tuple[str, str, str]:
    """The run directory and ``--resume`` of this run, given Ray's latest checkpoint (``saved``),
    and a line that says which checkpoint it continues from ("" if none).

    Ray's checkpoint is this run's when it was written in ``--out`` (or no ``--out`` was given: the
    run goes on in the checkpoint's own directory). It is then copied into
    ``<out>/checkpoints/step-N``, unless there already, and resumed from there: a job that Ray
    restarted on another machine, or after the run directory was lost, goes on bitwise. Another
    run's checkpoint (an earlier run in the same train function) is left alone.
    """
    from scaleloop.checkpoint.resume import run_dir_for
    from scaleloop.checkpoint.store import verify_checkpoint
    from scaleloop.output.rundir import default_run_dir

    out = run_dir_for(cfg)
    if saved is not None:
        with saved.as_directory() as directory:
            info = verify_checkpoint(Path(directory))
            its_out = info.meta.get("config", {}).get("out")
            out = out or (Path(its_out) if its_out else None)
            if its_out and out is not None and Path(its_out).resolve() == out.resolve():
                resume = _copy_checkpoint(info.path, info.step, out)
                return str(out), resume, f"scaleloop: continuing from Ray's checkpoint {saved.path} (step {info.step})"
            note = f"scaleloop: Ray's latest checkpoint {saved.path} is another run's (--out {its_out}): not resumed"
            return str(out or default_run_dir(cfg.model_data.model, cfg.model_data.data)), cfg.checkpointing.resume, note
    return str(out or default_run_dir(cfg.model_data.model, cfg.model_data.data)), cfg.checkpointing.resume, ""


def metrics_of(result: "RunResult") -> dict[str, Any]:
    """What Ray gets with each report: where the run is and its latest losses (finite ones only)."""
    metrics: dict[str, Any] = {"step": result.steps, "epoch": result.epochs, "samples": result.samples,
                               "train_loss": result.train_loss, "window_loss": result.window_loss}
    if result.test is not None:
        metrics.update(test_loss=result.test.loss, test_accuracy=result.test.accuracy)
    if result.wall_s:
        metrics.update(samples_per_s=result.samples_per_s, wall_s=result.wall_s)
    return {k: v for k, v in metrics.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


#: Ray's own setting (ray/train/v2/_internal/constants.py): how often its controller takes a
#: report from the workers, in seconds; 2 unless the driver's environment sets it.
RAY_POLL_VARIABLE, RAY_POLL_DEFAULT_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0


class HandOff:
    """Which checkpoints go to Ray (``ray.train.report``), and what handing them over cost.

    Ray's controller takes one report from the workers per poll (every 2 s by default), and a
    report waits until the one before it has been taken: handing Ray every checkpoint of a run
    that writes one every 0.1 s would leave training waiting 2 s for each. So a checkpoint is
    handed over only when the last hand-off is at least one poll old; the ones in between stay in
    the run directory, and the newest is handed over at the end if it was held back. Rank 0
    decides, and every rank follows (``ray.train.report`` is a barrier: all ranks call it alike).
    """

    def __init__(self, env: "DistEnv", interval_s: Optional[float] = None) -> None:
        self.env = env
        self.interval_s = float(os.environ.get(RAY_POLL_VARIABLE, RAY_POLL_DEFAULT_S)) if interval_s is None \
            else interval_s
        self.last: Optional[float] = None          # time.monotonic() of the last hand-off (rank 0)
        self.held: Optional[tuple[Optional[Path], dict[str, Any]]] = None   # the newest held back
        self.count = self.handed = 0
        self.seconds = 0.0                          # spent in ray.train.report for checkpoints, on this rank

    def written(self, path: Optional[Path], result: "RunResult") -> None:
        """A checkpoint was written (every rank is here; ``path`` is rank 0's directory)."""
        import time

        from scaleloop.runtime.collectives import broadcast_object

        self.count += 1
        due = self.last is None or time.monotonic() - self.last >= self.interval_s
        if broadcast_object(due if self.env.is_main else None, self.env):
            self._report(path, metrics_of(result))
        else:
            self.held = (path, metrics_of(result))

    def finish(self) -> None:
        """Hand over the newest checkpoint if it was held back (every rank calls this)."""
        if self.held is not None:
            self._report(*self.held)

    def _report(self, path: Optional[Path], metrics: dict[str, Any]) -> None:
        import time

        import ray.train

        start = time.perf_counter()
        # Ray copies the directory into its storage; scaleloop's copy stays (pruned by
        # --keep-checkpoints as always), so Ray must not delete it after the upload.
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if path is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, delete_local_checkpoint_after_upload=False)
        self.seconds += time.perf_counter() - start
        self.last, self.held = time.monotonic(), None
        self.handed += 1

    def line(self, result: "RunResult") -> str:
        """What the hand-off cost, beside what writing the checkpoints cost."""
        return (f"ray: {self.handed} of {self.count} checkpoint(s) handed to Ray in {self.seconds:.2f} s "
                f"(writing them took {result.checkpoint_s:.2f} s); at most one per {self.interval_s:g} s, "
                f"as often as Ray takes a report ({RAY_POLL_VARIABLE})")


def _copy_checkpoint(directory: Path, step: int, out: Path) -> str:
    """Ray's checkpoint of ``step`` as ``<out>/checkpoints/step-N`` (copied unless a copy that
    verifies is there already): resumed from there, it continues the run in ``out``."""
    from scaleloop.checkpoint.store import CHECKPOINTS_DIR, CheckpointError, step_dir_name, verify_checkpoint

    target = out / CHECKPOINTS_DIR / step_dir_name(step)
    try:
        verify_checkpoint(target)
    except CheckpointError:
        partial = target.with_name(f".{target.name}.from-ray")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(directory, partial)
        shutil.rmtree(target, ignore_errors=True)   # a damaged copy of the same step
        partial.rename(target)
    return str(target)


def join_beside_ray(env: "DistEnv") -> None:
    """The process group of a ``scaleloop train`` that a Ray Train worker started as a child.

    Ray's rank 0 worker listens on ``MASTER_PORT`` (Ray's own store): the child of each worker
    joins that store as a client, under a prefix of its own, so the children never bind the
    port nor read Ray's keys. The n-th child of each rank meets the n-th of the others (a count
    per rank, kept in the store), so children started one after another never mix.
    """
    import torch.distributed as torch_dist

    if not env.is_distributed or torch_dist.is_initialized():
        return
    if env.is_main:
        print("scaleloop: started by a Ray Train worker: training in a process group of its own beside Ray's "
              "(Ray gets no metrics or checkpoints from it; scaleloop.cli.main([\"train\", ...]) in the train "
              "function gives them, docs/ray.md)", flush=True)
    store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=env.group_timeout)
    nth = store.add(f"scaleloop/children-of-rank-{env.rank}", 1)
    torch_dist.init_process_group(backend=env.backend, store=torch_dist.PrefixStore(f"scaleloop/child-{nth}", store),
                                  rank=env.rank, world_size=env.world_size, timeout=env.group_timeout)


@contextlib.contextmanager
def printed_once() -> Iterator[None]:
    """While the block runs, each ``print`` of a Ray Train worker reaches the console once.

    Ray Train replaces ``print`` in its workers: each line goes to the logging module (whose
    console handler shows it) and, when ``sys.stdout`` is not the process's own stream, is printed
    there too. Ray's workers replace ``sys.stdout`` themselves, so every line would be shown
    twice; the block writes to the process's own stream instead. Outside Ray's ``print`` (a plain
    process) it changes nothing."""
    import builtins

    if builtins.print.__module__ == "builtins" or sys.__stdout__ is None:
        yield
        return
    saved = sys.stdout
    sys.stdout = sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = saved


@contextlib.contextmanager
def _rank_log(run_dir: Path, rank: int) -> Iterator["_RankLog"]:
    """This rank's output, also into ``<run>/logs/rank-<R>.log``.

    Ray Train replaces ``print`` in its workers with its own, which hands each line to the
    logging module (and prints it as well when stdout was replaced): there the log takes the
    lines from logging, else a copy of stdout and stderr. Copying both would log lines twice."""
    import builtins

    out, err = sys.stdout, sys.stderr
    log = _RankLog(run_dir, rank)
    handler: Optional[logging.Handler] = None
    if builtins.print.__module__ == "builtins":
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    else:
        handler = _LogHandler(log)
        logging.getLogger().addHandler(handler)
    try:
        with printed_once():
            yield log
    except BaseException:
        import traceback

        log.write(traceback.format_exc())   # Ray shows it on the console; the log keeps it with the run
        raise
    finally:
        sys.stdout, sys.stderr = out, err
        if handler is not None:
            logging.getLogger().removeHandler(handler)
        log.close()


class _LogHandler(logging.Handler):
    """Each logged line (Ray Train's ``print`` logs them) into a rank's log."""

    def __init__(self, log: "_RankLog") -> None:
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(self.format(record) + "\n")


class _RankLog:
    """A rank's log file, opened once rank 0 has claimed the run directory: a directory that holds
    only a ``logs/`` folder would not be a run's, and claiming it would be refused. What is
    written before then waits in memory."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        from scaleloop.output.rundir import LOGS_DIR

        self.run_dir, self.path = run_dir, run_dir / LOGS_DIR / f"rank-{rank}.log"
        self.pending: list[str] = []
        self.file: Optional[TextIO] = None

    def write(self, text: str) -> None:
        if self.file is None:
            self.pending.append(text)
            self._open()
        else:
            self.file.write(text)
            self.file.flush()

    def _open(self) -> None:
        from scaleloop.output.rundir import is_run_dir

        if not is_run_dir(self.run_dir):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")
        self.file.write("".join(self.pending))
        self.file.flush()
        self.pending.clear()

    def close(self) -> None:
        if self.file is None:
            self._open()
        if self.file is not None:
            self.file.close()


class _Tee(io.TextIOBase):
    """A console stream that also writes into a rank's log."""

    def __init__(self, console: TextIO, log: _RankLog) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.console.fileno()
