"""Who started this process: torchrun, ``srun``, or the user. Read from the environment alone.

Without torch, so that the launcher can tell whether it is a worker or the one that starts
them before anything slow is imported (``scaleloop.launching.launcher``).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from scaleloop.runtime import slurm


def launched_by_torchrun(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True inside a worker started by torchrun / torch.distributed.run (or a compatible launcher)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def launched_by_slurm(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True inside one of several tasks that ``srun`` started (each task is one worker).

    False for the batch script itself (it sees SLURM_NTASKS too, but is one process) and
    for a one-task job, which is not distributed.
    """
    env = os.environ if environ is None else environ
    ntasks = env.get("SLURM_NTASKS", "").strip()
    # Malformed values are left to DistEnv.from_env, which says what is wrong.
    return slurm.in_srun_step(env) and ntasks.isdigit() and int(ntasks) > 1
