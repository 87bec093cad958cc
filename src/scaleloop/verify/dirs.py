"""Where a verify run keeps its files (the report directory), in one place for parent and workers."""
from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.toml"      # the resolved TrainConfig of the distributed run
OPTIONS_FILE = "verify.json"     # the VerifyOptions
REFERENCE_DIR = "single"         # the one-process reference run's records
DISTRIBUTED_DIR = "dist"         # the N-process run's records (written by its rank 0)
LOCKSTEP_DIR = "lockstep"        # one process's steps, each from the N-process run's state before it
STATES_DIR = "states"            # the N-process run's full state at every step boundary (verify.lockstep)
LOG_FILE = "torchrun.log"        # everything torchrun and the workers printed


def reference_dir(root: Path) -> Path:
    return root / REFERENCE_DIR


def distributed_dir(root: Path) -> Path:
    return root / DISTRIBUTED_DIR


def lockstep_dir(root: Path) -> Path:
    return root / LOCKSTEP_DIR


def states_dir(root: Path) -> Path:
    return root / STATES_DIR
