"""A verified copy of each checkpoint on every machine, for jobs whose machines share no disk.

Rank 0 writes the checkpoints, into its own machine's run directory. Where the other machines
do not see that directory, losing machine 0 would lose the run's progress. So, once rank 0 has
written a checkpoint, it sends the checkpoint's files (manifest included) to the first process
of every other machine (its local rank 0), which writes them into its own run directory the same
atomic way, then checks every file against rank 0's manifest (sizes and SHA-256). After a
fault, the surviving machines resume from the newest checkpoint any of them holds
(:func:`newest_among_machines`).

When the run finishes, rank 0 sends its final weights (``model.pt``, and ``model.safetensors``
where written) the same way: each machine's run directory then holds the finished run, and
``scaleloop doctor`` reads it as finished there too (a failure record left by an earlier attempt
is older than the weights of the attempt that finished).

Whether the machines share the run directory is checked once per run (``--shared-fs auto``):
rank 0 leaves a file with a random name there, and each machine looks for it in its own
``--out``. ``--shared-fs yes`` skips the check and the copies; ``no`` copies without checking.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from scaleloop.checkpoint.store import (CHECKPOINTS_DIR, MANIFEST_FILE, CheckpointError, CheckpointInfo,
                                        copy_checkpoint, prune, retire_after, step_of)
from scaleloop.checkpoint.settings import CheckpointSettings
from scaleloop.errors import UsageError
from scaleloop.output.rundir import write_atomic
from scaleloop.runtime.collectives import broadcast_object, gather_object
from scaleloop.runtime.dist import DistEnv

Say = Callable[[str], None]
_PROBE = ".scaleloop-shared-fs-"
#: A finished run's final weights, as rank 0 writes them (``scaleloop.loop.result``); each machine keeps a copy.
FINAL_FILES = ("model.pt", "model.safetensors")


def machines(env: DistEnv) -> int:
    """How many machines the job runs on (torchrun gives each the same number of processes)."""
    return max(1, env.world_size // max(1, env.local_world_size))


@dataclass
class Replicas:
    """Which ranks keep a copy of each checkpoint, and where this rank keeps its own."""

    env: DistEnv
    keep: int
    holders: tuple[int, ...] = ()       # ranks that keep copies (local rank 0 of each machine but rank 0's)
    root: Optional[Path] = None         # this rank's checkpoints directory, if it is a holder

    @property
    def active(self) -> bool:
        return bool(self.holders)

    @classmethod
    def arrange(cls, env: DistEnv, settings: CheckpointSettings, run_dir: Optional[Path], *, sharded: bool,
                say: Say) -> "Replicas":
        """Decide, together (a collective on a job of several machines), who keeps copies.

        ``run_dir``: rank 0's run directory (None elsewhere). ``sharded``: the strategy writes
        its checkpoints from every rank into one directory, which needs a shared file system.
        """
        none = cls(env, settings.keep_checkpoints)
        if machines(env) == 1 or settings.shared_fs == "yes" or not settings.checkpoints:
            return none
        own = Path(settings.out) if settings.out else None
        leader = env.local_rank == 0
        if settings.shared_fs == "no":
            sees = [False] * env.world_size
            seen = gather_object(leader and own is not None, env)
        else:
            token = broadcast_object(secrets.token_hex(8) if env.is_main else None, env)
            probe = f"{_PROBE}{token}"
            if env.is_main and run_dir is not None:
                _write_probe(run_dir / probe)
            # Every rank joins the gathers; only local rank 0 of each machine looks.
            seen = gather_object(leader and own is not None, env)
            sees = gather_object(leader and own is not None and (own / probe).exists(), env)
            if env.is_main and run_dir is not None:
                (run_dir / probe).unlink(missing_ok=True)
        holders = tuple(r for r in range(1, env.world_size) if seen[r] and not sees[r])
        if not holders:
            if settings.shared_fs == "auto" and any(sees):
                say("checkpoints: every machine sees the run directory (a shared file system): one copy, "
                    "written by rank 0")
            return none
        if sharded:
            raise UsageError("this job's machines do not share the run directory (--shared-fs "
                             f"{settings.shared_fs}), and its strategy writes each checkpoint from every rank into one "
                             "directory: put --out on a file system every machine shares (and pass --shared-fs yes), "
                             "or use --strategy ddp, whose checkpoints are copied to every machine")
        say(f"checkpoints: the machines do not share the run directory; each keeps a verified copy of every "
            f"checkpoint ({len(holders)} cop{'y' if len(holders) == 1 else 'ies'} besides rank 0's)")
        root = own / CHECKPOINTS_DIR if env.rank in holders and own is not None else None
        return cls(env, settings.keep_checkpoints, holders, root)

    def copy(self, written: Optional[Path], say: Say) -> None:
        """After rank 0 wrote ``written`` (None elsewhere, or if it could not): every holder writes
        and verifies its copy. A collective; a holder that fails is reported, not fatal."""
        files = broadcast_object(_read_all(written) if self.env.is_main and written is not None else None, self.env)
        error = None
        if files is not None and self.root is not None:
            try:
                copy_checkpoint(self.root, step_of(Path(files["name"])), files["files"])
                prune(self.root, self.keep)
            except (OSError, CheckpointError) as exc:
                error = f"rank {self.env.rank}: {exc}"
        errors = [e for e in gather_object(error, self.env) if e]
        for e in errors:
            say(f"warning: a machine could not keep its copy of checkpoint {files['name'] if files else ''}: {e}")

    def copy_final(self, run_dir: Optional[Path], say: Say) -> None:
        """After rank 0 wrote the final weights into ``run_dir`` (None elsewhere, or if it could not):
        every holder writes them into its own run directory, then reads them back to check them. A
        collective (when copies are kept at all); a holder that fails is reported, not fatal."""
        if not self.active:
            return
        files = broadcast_object(_read_final(run_dir) if self.env.is_main and run_dir is not None else None, self.env)
        error = None
        if files and self.root is not None:
            try:
                for name, data in files.items():
                    write_atomic(self.root.parent / name, data)
                    if (self.root.parent / name).read_bytes() != data:
                        raise OSError(f"{self.root.parent / name} reads back different from rank 0's")
            except (OSError, UsageError) as exc:   # RunDirWriteError: a full or read-only disk
                error = f"rank {self.env.rank}: {exc}"
        errors = [e for e in gather_object(error, self.env) if e]
        for e in errors:
            say(f"warning: a machine could not keep its copy of the final weights: {e}")

    def retire_after(self, step: int) -> list[Path]:
        """A holder's copies of steps after ``step`` moved aside (as rank 0 does with its own)."""
        return retire_after(self.root, step) if self.root is not None else []


def _write_probe(path: Path) -> None:
    try:
        path.write_text(str(os.getpid()))
    except OSError:
        pass   # the run directory cannot be written: the checkpoint itself will say so


def _read_all(checkpoint: Path) -> dict:
    """The checkpoint's files, manifest included, by their names inside it."""
    files = {p.relative_to(checkpoint).as_posix(): p.read_bytes()
             for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    if MANIFEST_FILE not in files:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} has no {MANIFEST_FILE}")
    return {"name": checkpoint.name, "files": files}


def _read_final(run_dir: Path) -> dict[str, bytes]:
    """The final weights rank 0 wrote, by name (``model.safetensors`` only where it was written);
    nothing where they cannot be read (the others must still hear from rank 0)."""
    try:
        return {name: (run_dir / name).read_bytes() for name in FINAL_FILES if (run_dir / name).is_file()}
    except OSError:
        return {}


def newest_among_machines(env: DistEnv, mine: Optional[CheckpointInfo]) -> tuple[int, Optional[int]]:
    """The rank whose machine holds the newest checkpoint, and its step (a collective).

    Every rank passes what its machine holds (None: nothing, or not looked). Of two with the same
    step, the one written later wins: a machine that comes back may hold a checkpoint of that
    step from before a rewind; then the lowest rank, so rank 0's own is preferred.
    """
    keys = gather_object((mine.step, float(mine.meta.get("created") or 0.0)) if mine is not None else None, env)
    best = max((k for k in keys if k is not None), default=None)
    if best is None:
        return 0, None
    return keys.index(best), best[0]
