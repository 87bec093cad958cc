"""The run directory a run writes to: chosen, checked, locked, and whether it continues the run
there decided, once.

``scaleloop train --nproc N`` claims it in its launcher, before it starts the workers, and holds
it while they run (torchrun's restarts included). The claim is handed to the workers in their
environment (:data:`CLAIMED_VAR`, with the lock's writers entry): rank 0 then finds its
directory already claimed and only joins the claim, deciding nothing again. A run with no
scaleloop launcher (one process, the user's own torchrun or SLURM job, a notebook) claims it
on rank 0 itself, with the same rules. Torch-free: the launcher calls it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from scaleloop.checkpoint.resume import continues_run
from scaleloop.output.lock import RunDirLock, lock_run_dir
from scaleloop.output.rundir import default_run_dir, prepare_run_dir

# Set by a launcher for the workers it starts: the run directory it has claimed for them.
CLAIMED_VAR = "SCALELOOP_RUN_DIR_CLAIMED"


@dataclass
class RunDirClaim:
    """A claimed run directory and its lock (release it, or use the claim in ``with``)."""

    path: Path
    lock: RunDirLock
    by_launcher: bool = False    # claimed by the launcher of this process: only joined here

    def workers_env(self) -> dict[str, str]:
        """The environment entries that hand this claim to the processes this one starts."""
        return {CLAIMED_VAR: str(self.path), **self.lock.writers_env()}

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> "RunDirClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claimed_by_launcher(out: Path, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process's launcher has claimed ``out`` for it (:data:`CLAIMED_VAR`)."""
    claimed = (os.environ if environ is None else environ).get(CLAIMED_VAR)
    return bool(claimed) and Path(claimed).resolve() == Path(out).resolve()


def claim_run_dir(out: Optional[Path], model: str, data: str, *, source: Optional[Path] = None,
                  restarting: bool = False, from_copy: bool = False, nnodes: int = 1) -> RunDirClaim:
    """Claim the run directory ``out`` (None: a new one named after the model and data).

    The run continues the run already there when its launcher claimed the directory for it,
    when torchrun restarted it (``restarting``), when it resumes from this machine's copy of a
    checkpoint (``from_copy``), or when ``source``, the checkpoint it resumes, is one of that
    directory's own. Otherwise a run there is refused (``prepare_run_dir``), so nothing is
    overwritten. A job over several machines (``nnodes > 1``) takes no lock (``lock_run_dir``).
    """
    path = Path(out) if out is not None else default_run_dir(model, data)
    by_launcher = claimed_by_launcher(path)
    continuing = (by_launcher or restarting or from_copy
                  or (source is not None and continues_run(path, source)))
    path = prepare_run_dir(str(path), model, data, continuing=continuing)
    return RunDirClaim(path, lock_run_dir(path, single_node=nnodes == 1), by_launcher)
