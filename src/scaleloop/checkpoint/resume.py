"""``--resume auto|never|PATH``: which checkpoint a run continues from, and with which settings.

Torch-free, so that the launching process can check everything before it starts N workers.

Rules:

- ``never`` starts fresh (and refuses a ``--out`` that already holds a run).
- ``auto`` continues from the newest checkpoint in ``--out`` that verifies; a damaged newer one
  is skipped with a warning. No checkpoint there: a fresh start.
- ``PATH`` continues from that checkpoint (a run directory, its ``checkpoints/``, a ``step-N``
  directory or its ``state.pt``); a damaged one is an error. Without ``--out`` the run goes on
  in the checkpoint's own run directory.
- A worker group restarted by torchrun (``--max-restarts``) always takes the newest valid
  checkpoint of its run directory first: that is where the failed attempt left off.

A resumed run starts from the settings saved with its run (``<run>/config.toml``,
``scaleloop.config.saved_settings``); flags given on the command line override them, except those that
fix the data order and model shape (:data:`FIXED_ON_RESUME`), which must match the checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from scaleloop.checkpoint.store import (CHECKPOINTS_DIR, CheckpointError, CheckpointInfo, list_checkpoints,
                                        locate, newest_valid, run_dir_of, verify_checkpoint)
from scaleloop.checkpoint.settings import CheckpointSettings

# Settings that decide which samples step s holds, the model's shape and the optimizer's state
# layout: changing one mid-run would not continue the run but start a different one.
FIXED_ON_RESUME = ("model", "data", "data_dir", "hidden_dim", "d_model", "n_layers", "n_heads", "n_samples",
                   "input_dim", "image_size", "seq_len", "vocab_size", "test_fraction", "seed", "batch_size", "drop_last",
                   "optimizer", "lr", "weight_decay", "momentum", "lr_schedule", "warmup_steps",
                   "lr_scaling", "base_batch_size", "betas", "eps", "min_lr", "decay_params")

# What a run saved before a setting existed trained with: the value its checkpoints imply.
# (Weight decay then applied to every tensor, whatever the default is now.)
LEGACY_VALUES: dict[str, Any] = {"betas": None, "eps": None, "min_lr": 0.0, "decay_params": "all"}


def run_dir_for(settings: CheckpointSettings) -> Optional[Path]:
    """The run directory a resuming run writes to: ``--out``, else the checkpoint's own run."""
    if settings.out:
        return Path(settings.out)
    if settings.resume not in ("auto", "never"):
        return run_dir_of(locate(Path(settings.resume)))
    return None


def continues_run(out: Optional[Path], checkpoint: Path) -> bool:
    """Whether resuming ``checkpoint`` into ``out`` continues the run already there (the checkpoint
    is one of that run directory's own) rather than starting a new run from it."""
    source_run = run_dir_of(checkpoint)
    return out is not None and source_run is not None and source_run.resolve() == Path(out).resolve()


def find_checkpoint(settings: CheckpointSettings, *, restarting: bool, warn: Callable[[str], None]) -> Optional[CheckpointInfo]:
    """The verified checkpoint to continue from, or None for a fresh start (rules in the module doc)."""
    if restarting and settings.out:
        found = newest_valid(Path(settings.out) / CHECKPOINTS_DIR, warn)
        if found is not None:
            return found
    if settings.resume == "never":
        return None
    if settings.resume == "auto":
        if not settings.out:
            return None
        root = Path(settings.out) / CHECKPOINTS_DIR
        found = newest_valid(root, warn)
        if found is None and list_checkpoints(root) and not restarting:
            raise CheckpointError(f"every checkpoint in {str(root)!r} failed verification (see the warnings); "
                                  "nothing is deleted — resume one explicitly with --resume PATH, or start "
                                  "over in a new --out")
        return found
    return verify_checkpoint(locate(Path(settings.resume)))


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], source: str) -> None:
    """CheckpointError listing the data-order/model settings in which the ``current`` config (its
    fields as a mapping) differs from the ``saved`` one."""
    saved = {**LEGACY_VALUES, **saved}
    # Without weight decay, which tensors it would apply to changes nothing (one parameter group).
    moot = {"decay_params"} if not saved.get("weight_decay") and not current.get("weight_decay") else set()
    diffs = [(name, saved[name], current[name]) for name in FIXED_ON_RESUME
             if name in saved and name in current and name not in moot and saved[name] != current[name]]
    if not diffs:
        return
    was = " ".join(f"{_flag(n)} {_shown(old)}" for n, old, _ in diffs)
    now = " ".join(f"{_flag(n)} {_shown(new)}" for n, _, new in diffs)
    raise CheckpointError(f"cannot resume {source}: it was trained with {was}, this run asks for {now}; "
                          "these fix the data order, the model or the optimizer, so resume with the checkpoint's values "
                          "or start a new run (--resume never --out NEW_DIR)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return "(not set)" if value is None else str(value)
