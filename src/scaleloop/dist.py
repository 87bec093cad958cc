"""The distributed environment as one explicit object, and process-group set-up and teardown.

``DistEnv.from_env`` is the only place that reads the launcher's environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...). Everything else receives a ``DistEnv``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as torch_dist

from scaleloop.devices import device_for_local_rank, resolve_device
from scaleloop.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and which device and backend it uses.

    A ``DistEnv`` is a plain value: tests build one directly, without a process group.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, device: str = "auto",
                 backend: Optional[str] = None) -> "DistEnv":
        """Read rank and world size as set by torchrun (or nothing, for a plain ``python``)."""
        env = os.environ if environ is None else environ
        try:
            rank = int(env.get("RANK", "0"))
            world_size = int(env.get("WORLD_SIZE", "1"))
            local_rank = int(env.get("LOCAL_RANK", "0"))
            local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
        except ValueError as exc:
            raise UsageError(f"launcher environment is malformed: {exc}") from None
        if not 0 <= rank < world_size:
            raise UsageError(f"launcher environment: RANK={rank} is outside WORLD_SIZE={world_size}")
        base = resolve_device(device)
        dev = device_for_local_rank(base, local_rank)
        if backend is None and world_size > 1:
            backend = "nccl" if dev.type == "cuda" else "gloo"
        return cls(rank=rank, local_rank=local_rank, world_size=world_size,
                   local_world_size=local_world_size, device=dev, backend=backend)


def launched_by_torchrun(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True inside a worker started by torchrun / torch.distributed.run (or a compatible launcher)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times torchrun's elastic agent has restarted this worker group."""
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_process_group(env: DistEnv, timeout_s: float = 300.0) -> None:
    """Join the job's process group (a no-op for one process).

    torchrun has already set MASTER_ADDR/MASTER_PORT, so the default ``env://`` rendezvous is used.
    """
    if not env.is_distributed or torch_dist.is_initialized():
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    torch_dist.init_process_group(
        backend=env.backend, rank=env.rank, world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=env.device if env.device.type == "cuda" else None,
    )


def destroy_process_group() -> None:
    """Leave the process group if one was joined."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
