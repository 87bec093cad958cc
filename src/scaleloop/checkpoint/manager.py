"""Saving and restoring a training run's full state, through the strategy, on every rank.

Save (every rank calls it at the same step, because it holds collectives):

1. the strategy gives the model and optimizer state (for replicas: the full state on rank 0);
2. every rank's RNG states (and, for a stateful stream, where its reader stands: ``data_state``)
   are all-gathered, and the run's loss sums all-reduced, so the rank that writes holds them all
   — every rank joins both collectives, none is rank-0-only;
3. the writing rank puts model, optimizer, scheduler, GradScaler, position, sums, RNG states,
   the streams' states and the resolved config into one weights-only file, written atomically
   (see ``store``).

With ``--async-checkpoint`` steps 1 and 2 are the same, on the training thread; the writing rank
then copies the state into host memory and writes step 3 in a thread (``checkpoint.background``),
and :meth:`Checkpointer.wait` completes it at the next save, the run's end, a stop or a resume: the
outcome sent to every rank, its error raised there as a synchronous save raises it.

Restore: rank 0 picks and verifies the checkpoint and broadcasts its bytes, so every rank
loads exactly the same state even without a shared file system, and an error is raised on
every rank alike instead of leaving the others waiting.

The model and optimizer are the strategy's: ``strategy.save_checkpoint`` gets the temporary
checkpoint directory (on rank 0, which writes ``state.pt``) and returns ``state.pt``'s model and
optimizer entries there; ``strategy.load_checkpoint`` loads them back, whichever strategy and
world size wrote them. A sharded strategy (FSDP) has every rank write its shards into that
directory (``torch.distributed.checkpoint``) and returns a marker instead; rank 0 then adds
``state.pt`` and the manifest over all files, and renames it into place. Reading the shards
back needs a directory every rank sees: a file system shared by all nodes.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch import nn

from scaleloop.checkpoint.background import (BackgroundWrite, InFlight, Outcome, ShardedSave, checkpoint_group,
                                             host_copy, other_ranks_shards, why_not_written)
from scaleloop.checkpoint.replicas import Replicas, machines, newest_among_machines
from scaleloop.checkpoint.resume import check_compatible, find_checkpoint
from scaleloop.checkpoint.state import capture_rng, from_bytes, restore_rng, state_bytes, to_bytes
from scaleloop.checkpoint.store import (CHECKPOINTS_DIR, FORMAT_VERSION, CheckpointError, begin_checkpoint,
                                        STATE_FILE, retire_after, step_dir_name)
from scaleloop.checkpoint.settings import CheckpointSettings
from scaleloop.checkpoint.writing import SLACK, continue_hint, room_for, write_error, write_files
from scaleloop.output.rundir import RunDirWriteError
from scaleloop.runtime.collectives import broadcast_object, gather_object, sum_over_ranks
from scaleloop.runtime.dist import DistEnv


class Stateful(Protocol):
    """What a checkpoint needs of a strategy (``scaleloop.strategies.base.Strategy`` is one).

    A protocol, not the class: checkpoints sit below the strategies in the layers, and any object
    that saves and loads the model and optimizer this way can be checkpointed.
    """

    name: str
    env: DistEnv
    precision: Any
    batch_split: str
    #: Every rank writes its part of a checkpoint into one directory (else rank 0 writes it whole).
    writes_sharded: bool

    def save_checkpoint(self, model: Any, optimizer: Any, directory: Optional[Path],
                        background: Optional[ShardedSave] = None) -> Any: ...

    def load_checkpoint(self, model: Any, optimizer: Any, state: Any, directory: Path) -> None: ...


@dataclass
class Progress:
    """Where a run stands: the next optimizer step to take is step ``step_in_epoch`` of ``epoch``."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    train_s: float = 0.0
    skipped_steps: int = 0      # optimizer steps the fp16 GradScaler skipped so far (counted in global_step)
    #: The global step the log window in the saved loss sums began after (its last log row); None in a
    #: checkpoint written before it was kept (see :meth:`log_window_from`).
    window_from: Optional[int] = None

    def log_window_from(self, log_every: int) -> int:
        """The step the saved log window began after: as saved, else the last multiple of
        ``log_every`` (right unless ``--log-every`` changed since)."""
        return self.window_from if self.window_from is not None else self.global_step - self.global_step % log_every


@dataclass
class Resumed:
    """What :meth:`Checkpointer.restore` loaded, for the loop to continue from."""

    source: Path
    progress: Progress
    sums: torch.Tensor              # the loop's running sums (all ranks' total, on rank 0)
    saved_world_size: int
    notes: list[str] = field(default_factory=list)
    copy_on_rank: Optional[int] = None   # read from this rank's machine's copy (checkpoint.replicas), not rank 0's
    data: Any = None   # this rank's saved data state (a stateful stream's place in its pass), if any


class Checkpointer:
    """Writes checkpoints of one run (rank 0's ``run_dir``) and restores them on every rank."""

    def __init__(self, strategy: Stateful, settings: CheckpointSettings, config: Mapping[str, Any], *,
                 seed: int, say: Callable[[str], None]) -> None:
        self.strategy = strategy
        self.settings = settings
        #: The run's ``--seed``: a rank the saving run did not have seeds its fresh streams from it.
        self.seed = seed
        #: The run's whole config (flat fields), saved in each checkpoint and compared on resume.
        self.config = dict(config)
        self.say = say
        self.root: Optional[Path] = None   # set on the writing rank once the run directory exists
        self.written = 0
        self.seconds = 0.0              # what training waited for checkpoints (with a thread: copies and waits)
        self.background_seconds = 0.0   # what the background writes took (--async-checkpoint)
        self._pending: Optional[InFlight] = None   # the write in flight (--async-checkpoint)
        self._group: Any = None                    # the Gloo group of DCP's background writes, once made
        self.last_path: Optional[Path] = None
        self._last_step: Optional[int] = None
        self.replicas = Replicas(strategy.env, settings.keep_checkpoints)   # none until attach()
        #: Called at each save on every rank: the data's own state (plain values and tensors), or None.
        self.data_state: Optional[Callable[[], Any]] = None
        self._warned_data = False

    @property
    def last_step(self) -> Optional[int]:
        """The step of the newest checkpoint this run wrote or resumed from (on every rank), if any."""
        return self._last_step

    def attach(self, run_dir: Optional[Path]) -> None:
        """Write into ``run_dir/checkpoints`` (None on ranks that do not write); on a job of several
        machines, also decide which keep copies (a collective: every rank calls it)."""
        self.root = run_dir / CHECKPOINTS_DIR if run_dir is not None else None
        self.replicas = Replicas.arrange(self.strategy.env, self.settings, run_dir, sharded=self.strategy.writes_sharded,
                                         say=self.say)

    def keep_final_copies(self, run_dir: Optional[Path]) -> None:
        """Once rank 0 wrote the final weights into ``run_dir`` (None elsewhere, or if it could not),
        each machine that keeps copies of the checkpoints keeps a copy of them too (a collective)."""
        self.replicas.copy_final(run_dir, self.say)

    def retire_after(self, step: int) -> list[Path]:
        """On the writing rank (and a machine's copies): move the checkpoints of steps after ``step`` aside."""
        mine = retire_after(self.root, step) if self.root is not None else []
        return mine + self.replicas.retire_after(step)

    # --- save -------------------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             progress: Progress, sums: torch.Tensor) -> Optional[Path]:
        """Checkpoint the run (every rank must call this at the same point). Returns the path written;
        with ``--async-checkpoint`` None: the files are written in the background (``checkpoint.background``)
        and :meth:`wait` completes them. Either way the write in flight before, if any, is completed first."""
        if not self.settings.checkpoints or self._last_step == progress.global_step:
            return None
        self.wait()
        started = time.perf_counter()
        env, step = self.strategy.env, progress.global_step
        sharded = (ShardedSave(self._checkpoint_group()) if self.settings.async_checkpoint
                   and self.strategy.writes_sharded else None)
        tmp, model_and_optim, error, needed = self._begin(model, optimizer, step, sharded)
        # One collective for both: each rank's RNGs and its data state (a stream each rank reads).
        gathered = gather_object((capture_rng(env.device), self.data_state() if self.data_state else None), env)
        rngs = [rng for rng, _ in gathered]
        data_states = self._loadable([data for _, data in gathered])
        totals = sum_over_ranks(sums, env).cpu()
        previous, self._last_step = self._last_step, step
        if not self.settings.async_checkpoint:
            path, refused = None, False
            if tmp is not None and model_and_optim is not None:
                state, meta = self._contents(model_and_optim, scheduler, progress, totals, rngs, data_states)
                path, error, refused = self._write(step, tmp, state, meta, needed)
            path = self._conclude(path, error, refused, previous)
            self.seconds += time.perf_counter() - started
            return path
        # An error before the write (no room, no directory) stops every rank now, as without a thread.
        self._conclude_early(error, previous)
        if tmp is not None and model_and_optim is not None:
            state, meta = self._contents(model_and_optim, scheduler, progress, totals, rngs, data_states)
            copy = host_copy(state)   # training changes the tensors in place from the next step on
            write = BackgroundWrite(step, partial(self._write, step, tmp, copy, meta, needed,
                                                  sharded.wait if sharded is not None else None))
            self._pending = InFlight(step, previous, write.wait, write)
        else:   # this rank's shards (if any) are in DCP's thread; rank 0's outcome says how they went
            self._pending = InFlight(step, previous, partial(other_ranks_shards, sharded))
        self.seconds += time.perf_counter() - started
        return None

    def _begin(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
               sharded: Optional[ShardedSave]) -> tuple[Optional[Path], Any, Optional[str], Optional[int]]:
        """The checkpoint's temporary directory (on the writing rank) and the strategy's model and
        optimizer state for it (every rank: a sharded strategy writes its shards into that directory,
        or, with ``sharded``, hands them to DCP's thread); the one-line error if it failed, and the
        space it was checked to need."""
        strategy = self.strategy
        env = strategy.env
        tmp, error = None, None
        where = self.root / step_dir_name(step) if self.root is not None else None
        # A sharded checkpoint is written by every rank at once: what they will write, summed over
        # ranks, is checked against the space free before any of it is (one collective; a whole
        # checkpoint is checked in _write, once its bytes are known).
        needed = (int(sum_over_ranks([state_bytes(model, optimizer)], env)[0]) + SLACK
                  if strategy.writes_sharded else None)
        if self.root is not None and where is not None:
            try:
                room_for(self.root, needed)
                tmp = begin_checkpoint(self.root, step)
            except OSError as exc:
                error = self._write_error(where, exc, needed)
        try:
            model_and_optim = (strategy.save_checkpoint(model, optimizer, tmp, sharded) if sharded is not None
                               else strategy.save_checkpoint(model, optimizer, tmp))
        except OSError as exc:
            # A sharded write that failed on any rank (disk full part-way) fails on every rank alike.
            model_and_optim = None
            if tmp is not None and where is not None:
                error = self._write_error(where, exc, needed, tmp)
                tmp = None
        return tmp, model_and_optim, error, needed

    def _contents(self, model_and_optim: dict[str, Any], scheduler: Any, progress: Progress, totals: torch.Tensor,
                  rngs: list[Any], data_states: Optional[list[Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``state.pt``'s entries and the manifest's metadata of the checkpoint of ``progress``."""
        strategy, env = self.strategy, self.strategy.env
        config = dict(self.config)
        state = {
            "format_version": FORMAT_VERSION,
            **model_and_optim,
            "scheduler": scheduler.state_dict() if scheduler is not None else {},
            "scaler": strategy.precision.state_dict(),
            "progress": asdict(progress),
            "sums": totals,
            "rng": rngs,
            "world_size": env.world_size,
            "strategy": strategy.name,
            "config": config,
        }
        if data_states is not None:
            state["data"] = data_states
        meta = {"epoch": progress.epoch, "step_in_epoch": progress.step_in_epoch,
                "samples": progress.samples, "world_size": env.world_size,
                "strategy": strategy.name, "config": config}
        if "sharded" in model_and_optim:   # the manifest names the format too
            meta["sharded"] = model_and_optim["sharded"]
        return state, meta

    def _conclude(self, path: Optional[Path], error: Optional[str], refused: bool, previous: Optional[int]) -> Optional[Path]:
        """Every rank, once a checkpoint's write is over: the writing rank's error raised on every rank
        alike, else the checkpoint counted and copied to the other machines (``checkpoint.replicas``)."""
        env = self.strategy.env
        if env.world_size > 1:
            # Only the writing rank knows; every rank must stop alike, not wait in the next collective.
            error, refused = broadcast_object((error, refused), env)
        if error is not None:
            self._last_step = previous
            raise (CheckpointError if refused else RunDirWriteError)(error)
        if path is not None:
            self.last_path = path
        if self.replicas.active:
            self.replicas.copy(path, self.say)
        self.written += 1
        return path

    def _conclude_early(self, error: Optional[str], previous: Optional[int]) -> None:
        """``--async-checkpoint``: an error before the write (no room, no directory) raised on every rank now."""
        env = self.strategy.env
        if env.world_size > 1:
            error = broadcast_object(error, env)
        if error is not None:
            self._last_step = previous
            raise RunDirWriteError(error)

    def _checkpoint_group(self) -> Any:
        """The Gloo group of DCP's background writes, made at the first (every rank saves at once)."""
        if self._group is None:
            self._group = checkpoint_group(self.strategy.env)
        return self._group

    # --- the write in flight (--async-checkpoint) ----------------------------------------------
    @property
    def pending_step(self) -> Optional[int]:
        """The step of the checkpoint being written in the background, if any (the same on every rank)."""
        return self._pending.step if self._pending is not None else None

    def wait(self) -> Optional[Path]:
        """Complete the checkpoint written in the background, if any. Every rank calls it at the same
        point (the next save, the run's end, a stop, a resume): the writing rank's outcome is sent to
        every rank, its error raised on each as a synchronous save raises it, and a machine's copy
        made. Returns the path written (on the writing rank), else None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        started = time.perf_counter()
        try:
            path, error, refused = pending.outcome()
            return self._conclude(path, error, refused, pending.previous)
        finally:
            self.seconds += time.perf_counter() - started   # what training waited for it
            if pending.write is not None:
                self.background_seconds += pending.write.seconds

    def wait_alone(self) -> None:
        """When an exception leaves the loop (on this rank only, perhaps): let the write in flight end,
        without :meth:`wait`'s collectives, which ranks that stopped elsewhere would never join. A write
        that failed is said, not raised: the exception that stopped the run is the one to report."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            _, error, _ = pending.outcome()
        except Exception as exc:   # noqa: BLE001 - reported; the exception on its way out goes on
            error = why_not_written(exc)
        if error is not None:
            self._last_step = pending.previous
            self.say(f"warning: the checkpoint of step {pending.step} was not written: {error}")

    def _loadable(self, states: list[Any]) -> Optional[list[Any]]:
        """``states`` if any is set and all load back weights-only; else None (a resume then
        re-reads the pass), with a warning once: a checkpoint that cannot be loaded is worse."""
        if all(s is None for s in states):
            return None
        try:
            from_bytes(to_bytes({"model": {}, "data": states}), "the data state")
        except CheckpointError:
            if not self._warned_data:
                self._warned_data = True
                self.say("warning: the training stream's state_dict() holds values other than tensors, numbers, "
                         "strings and containers of them, which a weights-only checkpoint cannot keep; resuming "
                         "re-reads the pass up to its step instead (docs/streaming.md)")
            return None
        return states

    def continue_hint(self, once: str) -> str:
        """``the newest valid checkpoint is X; once <once>, continue with: scaleloop train --out R``
        (on the writing rank; verifies the checkpoint it names)."""
        return continue_hint(self.root, once) if self.root is not None else ""

    def _write_error(self, file: Path, exc: OSError, needed: Optional[int], tmp: Optional[Path] = None) -> str:
        return write_error(self.root, file, exc, needed, tmp)

    def _write(self, step: int, tmp: Path, state: dict[str, Any], meta: dict[str, Any], needed: Optional[int],
               shards: Optional[Callable[[], None]] = None) -> Outcome:
        """The writing rank's files of the checkpoint of ``step`` (``checkpoint.writing``)."""
        assert self.root is not None
        return write_files(self.root, self.settings.keep_checkpoints, step, tmp, state, meta, needed, shards)

    # --- restore ----------------------------------------------------------------------------
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                restarting: bool) -> Optional[Resumed]:
        """Find, verify and load the checkpoint that ``cfg.checkpointing.resume`` names (None: fresh start)."""
        self.wait()   # a checkpoint still being written is one to choose from
        strategy = self.strategy
        env = strategy.env
        payload: tuple[Optional[str], Optional[bytes], Optional[str]] = (None, None, None)
        # On several machines without a shared disk, each machine's first process looks in its own
        # run directory (copies, see checkpoint.replicas), and the newest checkpoint any holds wins.
        anywhere = machines(env) > 1 and self.settings.shared_fs != "yes" and self.settings.resume == "auto"
        looks = env.is_main or (anywhere and env.local_rank == 0)
        info, error = None, None
        if looks:
            try:
                info = find_checkpoint(self.settings, restarting=restarting, warn=self.say if env.is_main else _quiet)
            except (CheckpointError, OSError) as exc:
                error = str(exc)
        src = newest_among_machines(env, info)[0] if anywhere else 0
        if env.rank == src:
            try:
                payload = (error, info.state_file.read_bytes(), str(info.path)) if info is not None else (error, None, None)
            except OSError as exc:
                payload = (str(exc), None, None)
        error, data, source = broadcast_object(payload, env, src=src)
        if error is not None:
            raise CheckpointError(error)
        if data is None or source is None:
            return None
        state = from_bytes(data, str(Path(source) / STATE_FILE))
        if isinstance(state.get("config"), Mapping):
            check_compatible(state["config"], self.config, source)
        try:
            strategy.load_checkpoint(model, optimizer, state, Path(source))
            if scheduler is not None and state.get("scheduler"):
                scheduler.load_state_dict(state["scheduler"])
            strategy.precision.load_state_dict(state.get("scaler") or {})
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{source} cannot be loaded into this run: {' '.join(str(exc).split())[:300]}") from None

        notes = []
        saved_world = int(state.get("world_size", 1))
        rngs = list(state.get("rng") or [])
        if rngs:
            restore_rng(rngs[min(env.rank, len(rngs) - 1)], env.device)
        progress = Progress(**state["progress"])
        self._last_step = progress.global_step  # saving this very state again would add nothing
        if saved_world != env.world_size:
            notes.append(f"note: the checkpoint was written by {saved_world} process(es), this run has "
                         f"{env.world_size}; the global batch is unchanged, so step {progress.step_in_epoch} "
                         f"of the epoch holds the same samples, now {strategy.batch_split}")
            if env.rank >= len(rngs):
                # A rank that did not exist gets its own fresh stream, as a new worker would.
                torch.manual_seed(self.seed + env.rank + 1_000_003 * progress.global_step)
        sums = state["sums"].to(env.device) if env.is_main else torch.zeros_like(state["sums"], device=env.device)
        if src != 0:
            notes.append(f"note: rank 0's machine held no checkpoint this new; the copy on rank {src}'s machine "
                         f"({source}) was sent to every rank")
        data_states = list(state.get("data") or [])
        # Every rank reads the same stream: a rank the saving run did not have takes rank 0's.
        data = data_states[env.rank if env.rank < len(data_states) else 0] if data_states else None
        return Resumed(source=Path(source), progress=progress, sums=sums,
                       saved_world_size=saved_world, notes=notes, copy_on_rank=src or None, data=data)


def _quiet(_msg: str) -> None:
    """Warnings of a machine other than rank 0's go nowhere: rank 0 speaks for the run."""
