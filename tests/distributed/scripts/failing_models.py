"""User models that misbehave on rank 1, for the failure reports (tests/distributed/test_failures_dist.py).

``--model failing_models:raises``: rank 1 raises ValueError at its third forward.
``--model failing_models:stalls``: rank 1 sleeps for a long time at its third forward.
``--model failing_models:exits`` / ``:killed``: rank 1 ends at its third forward without a Python
error: ``os._exit(3)``, or SIGKILL (as from the out-of-memory killer).
``--model failing_models:bad_output``: every rank's forward returns a string (bad input: a usage error).
``--model failing_models:nan_on_rank_1`` (``:nan_on_rank_1_recorded_late``): rank 1's loss becomes
NaN at its third forward (and rank 0 records the ending only once rank 1 waits for it).
The rank is read as a user would, from torch.distributed.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _Misbehaving(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.how = how
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.how == "evaluate" and not self.training and dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("bad test batch on rank 1")  # EVAL-LINE
        in_training = self.how in ("raise", "sleep", "exit", "kill")
        if in_training and self.training and dist.is_initialized() and dist.get_rank() == 1 and self.calls == 3:
            if self.how == "raise":
                raise ValueError("bad batch on rank 1")  # RAISE-LINE
            if self.how == "exit":
                print("rank 1: about to leave", flush=True)
                os._exit(3)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # SLEEP-LINE
        return self.net(x.flatten(1))


def raises(info: Any = None) -> nn.Module:
    return _Misbehaving("raise")


def stalls(info: Any = None) -> nn.Module:
    return _Misbehaving("sleep")


def fails_in_evaluation(info: Any = None) -> nn.Module:
    return _Misbehaving("evaluate")


def fails_at_start(info: Any = None) -> nn.Module:
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("cannot build this model on rank 1")  # BUILD-LINE
    return _Misbehaving("none")


def exits(info: Any = None) -> nn.Module:
    return _Misbehaving("exit")


def killed(info: Any = None) -> nn.Module:
    return _Misbehaving("kill")


class _SaysHello(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> str:
        return "hello"  # not a tensor: scaleloop stops with one line (exit 2)


def bad_output(info: Any = None) -> nn.Module:
    return _SaysHello()


class _WrongWidth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(32, 10)   # the data has 64 features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))  # WIDTH-LINE


def wrong_width(info: Any = None) -> nn.Module:
    """A shape mismatch in the user's own forward, on every rank (also at one process)."""
    return _WrongWidth()


class _NaNOnRank1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.net(x.flatten(1))
        if self.training and self.calls >= 3 and dist.is_initialized() and dist.get_rank() == 1:
            return out * float("nan")
        return out


def nan_on_rank_1(info: Any = None) -> nn.Module:
    """Rank 1's loss becomes NaN at its third forward (a bad batch of its own); rank 0's stays finite."""
    return _NaNOnRank1()


def nan_on_rank_1_recorded_late(info: Any = None) -> nn.Module:
    """As :func:`nan_on_rank_1`, and rank 0 records the run's ending only once rank 1 waits for it
    (the file ``$FAILING_MODELS_WAITING`` says so): a rank 1 that exits instead has torchrun end
    rank 0 before its record, as a busy machine can have it happen.

    Not a user's path: the loop's ``record_ending`` (rank 0) and the launcher's wait (rank 1) are
    wrapped.
    """
    import scaleloop.launching.launcher as launcher
    import scaleloop.loop.training as training

    waiting = Path(os.environ["FAILING_MODELS_WAITING"])
    if dist.get_rank() == 1:
        meet = getattr(launcher, "_meet_before_exit", None)   # (None: a scaleloop without the wait)

        def announced(env: Any) -> None:
            waiting.touch()
            if meet is not None:
                meet(env)

        launcher._meet_before_exit = announced
    else:
        recorded = training.record_ending

        def late(run_dir: Any, exc: BaseException, step: int) -> None:
            deadline = time.monotonic() + 120
            while not waiting.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            recorded(run_dir, exc, step)

        training.record_ending = late
    return _NaNOnRank1()
