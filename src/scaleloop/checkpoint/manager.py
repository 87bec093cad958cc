"""Saving and restoring a training run's full state, through the strategy, on every rank.

Save (every rank calls it at the same step, because it holds collectives):

1. the strategy gives the model and optimizer state (for replicas: the full state on rank 0);
2. every rank's RNG states are all-gathered, and the run's loss sums all-reduced, so the
   rank that writes holds them all — every rank joins both collectives, none is rank-0-only;
3. the writing rank puts model, optimizer, scheduler, GradScaler, position, sums, RNG states
   and the resolved config into one weights-only file, written atomically (see ``store``).

Restore: rank 0 picks and verifies the checkpoint and broadcasts its bytes, so every rank
loads exactly the same state even without a shared file system, and an error is raised on
every rank alike instead of leaving the others waiting.

Sharded strategies (``strategy.sharded_checkpoint``, FSDP) differ in who writes the model and
optimizer: rank 0 creates the temporary checkpoint directory and tells every rank its name,
every rank writes its shards into it with ``torch.distributed.checkpoint`` (``save_sharded``),
then rank 0 adds ``state.pt`` (everything else) and the manifest over all files, and renames
it into place. On restore every rank reads the shards it needs itself (``load_sharded``), on
any world size. That needs a directory every rank sees: a file system shared by all nodes.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from scaleloop.checkpoint.resume import check_compatible, find_checkpoint
from scaleloop.checkpoint.state import (capture_rng, check_model_state, from_bytes, restore_rng,
                                        to_bytes)
from scaleloop.checkpoint.store import (CHECKPOINTS_DIR, FORMAT_VERSION, STATE_FILE, CheckpointError,
                                        begin_checkpoint, finish_checkpoint, prune, retire_after,
                                        write_checkpoint)
from scaleloop.config import TrainConfig
from scaleloop.strategies import distcp
from scaleloop.strategies.base import Strategy

#: ``state.pt``'s marker (and the manifest's) for a checkpoint whose model and optimizer state are
#: in ``torch.distributed.checkpoint`` files beside it rather than in ``state.pt``.
SHARDED_FORMAT = "torch.distributed.checkpoint"


@dataclass
class Progress:
    """Where a run stands: the next optimizer step to take is step ``step_in_epoch`` of ``epoch``."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    train_s: float = 0.0


@dataclass
class Resumed:
    """What :meth:`Checkpointer.restore` loaded, for the loop to continue from."""

    source: Path
    progress: Progress
    sums: torch.Tensor              # the loop's running sums (all ranks' total, on rank 0)
    saved_world_size: int
    notes: list[str] = field(default_factory=list)


class Checkpointer:
    """Writes checkpoints of one run (rank 0's ``run_dir``) and restores them on every rank."""

    def __init__(self, strategy: Strategy, cfg: TrainConfig, *, say: Callable[[str], None]) -> None:
        self.strategy = strategy
        self.cfg = cfg
        self.say = say
        self.root: Optional[Path] = None   # set on the writing rank once the run directory exists
        self.written = 0
        self.seconds = 0.0
        self.last_path: Optional[Path] = None
        self._last_step: Optional[int] = None

    def attach(self, run_dir: Optional[Path]) -> None:
        """Write into ``run_dir/checkpoints`` (None on ranks that do not write)."""
        self.root = run_dir / CHECKPOINTS_DIR if run_dir is not None else None

    def retire_after(self, step: int) -> list[Path]:
        """On the writing rank: move this run's checkpoints of steps after ``step`` aside."""
        return retire_after(self.root, step) if self.root is not None else []

    # --- save -------------------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             progress: Progress, sums: torch.Tensor) -> Optional[Path]:
        """Checkpoint the run (every rank must call this at the same point). Returns the path written."""
        if not self.cfg.checkpoints or self._last_step == progress.global_step:
            return None
        started = time.perf_counter()
        strategy = self.strategy
        env = strategy.env
        writer = strategy.writes_checkpoint and self.root is not None
        tmp: Optional[Path] = None
        if strategy.sharded_checkpoint:
            # Rank 0 names the directory; every rank writes its shards into it.
            if writer:
                tmp = begin_checkpoint(self.root, progress.global_step)
            shared = strategy.broadcast_object(str(tmp) if tmp is not None else None)
            if shared is not None:
                strategy.save_sharded(model, optimizer, Path(shared))
            model_and_optim: dict[str, Any] = {"sharded": SHARDED_FORMAT}
        else:
            model_and_optim = strategy.checkpoint_state(model, optimizer)
        rngs = strategy.gather_object(capture_rng(env.device))
        totals = strategy.reduce_sum(sums.detach().clone()).cpu()
        self._last_step = progress.global_step
        path = None
        error: Optional[str] = None
        if writer:
            config = asdict(self.cfg)
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
            meta = {"epoch": progress.epoch, "step_in_epoch": progress.step_in_epoch,
                    "samples": progress.samples, "world_size": env.world_size,
                    "strategy": strategy.name, "config": config}
            files = {STATE_FILE: to_bytes(state)}
            if tmp is not None:
                error = _missing_shards(tmp)
                if error is None:
                    path = finish_checkpoint(self.root, progress.global_step, tmp, files,
                                             {**meta, "sharded": SHARDED_FORMAT})
            else:
                path = write_checkpoint(self.root, progress.global_step, files, meta)
            if path is not None:
                prune(self.root, self.cfg.keep_checkpoints)
                self.last_path = path
        if strategy.sharded_checkpoint:
            # Every rank stops alike if rank 0 could not complete the checkpoint.
            error = strategy.broadcast_object(error)
            if error is not None:
                raise CheckpointError(error)
        self.written += 1
        self.seconds += time.perf_counter() - started
        return path

    # --- restore ----------------------------------------------------------------------------
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                restarting: bool) -> Optional[Resumed]:
        """Find, verify and load the checkpoint that ``cfg.resume`` names (None: fresh start)."""
        strategy = self.strategy
        env = strategy.env
        payload: tuple[Optional[str], Optional[bytes], Optional[str]] = (None, None, None)
        if env.is_main:
            try:
                info = find_checkpoint(self.cfg, restarting=restarting, warn=self.say)
                if info is not None:
                    payload = (None, info.state_file.read_bytes(), str(info.path))
            except (CheckpointError, OSError) as exc:
                payload = (str(exc), None, None)
        error, data, source = strategy.broadcast_object(payload)
        if error is not None:
            raise CheckpointError(error)
        if data is None or source is None:
            return None
        state = from_bytes(data, source)
        if isinstance(state.get("config"), Mapping):
            check_compatible(state["config"], self.cfg, source)
        sharded = state.get("sharded") is not None
        if sharded:
            _check_sharded(strategy, model, Path(source))
        else:
            check_model_state(strategy.expected_model_state(model), state["model"], source)
        try:
            if sharded:
                strategy.load_sharded(model, optimizer, Path(source))
            else:
                strategy.load_checkpoint_state(model, optimizer, state)
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
                         "of the epoch holds the same samples, "
                         + ("each seen whole by every pipeline stage" if strategy.name == "pipeline"
                            else "now split over the new ranks"))
            if env.rank >= len(rngs):
                # A rank that did not exist gets its own fresh stream, as a new worker would.
                torch.manual_seed(self.cfg.seed + env.rank + 1_000_003 * progress.global_step)
        sums = state["sums"].to(env.device) if env.is_main else torch.zeros_like(state["sums"], device=env.device)
        return Resumed(source=Path(source), progress=progress, sums=sums,
                       saved_world_size=saved_world, notes=notes)


def _missing_shards(directory: Path) -> Optional[str]:
    """On rank 0, after every rank wrote its shards: None if all of them are in ``directory``."""
    present = {p.name for p in directory.iterdir()}
    missing = sorted(distcp.referenced_files(directory) - present) if distcp.METADATA_FILE in present else ["(.metadata)"]
    if not missing:
        return None
    return (f"sharded checkpoint {str(directory)!r} is incomplete: {', '.join(missing[:4])} written by other ranks "
            "are not there; every rank writes its own shards, so the run directory must be on a file system "
            "that all nodes share")


def _check_sharded(strategy: Strategy, model: nn.Module, directory: Path) -> None:
    """Before loading a sharded checkpoint: every rank sees it, and it fits the model (same error on all ranks)."""
    seen = strategy.gather_object((directory / distcp.METADATA_FILE).is_file())
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(f"sharded checkpoint {str(directory)!r} is not visible to rank(s) "
                              f"{', '.join(map(str, blind))}: every rank reads its shards itself, so the run "
                              "directory must be on a file system that all nodes share")
    saved = {key: (torch.empty(shape, device="meta") if shape is not None else None)
             for key, shape in distcp.saved_model_shapes(directory).items()}
    check_model_state(strategy.expected_model_state(model), saved, str(directory))
