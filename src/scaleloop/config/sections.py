"""The config's sections whose owners sit above the config: the trainer's optimizer and schedule,
its evaluations, and the launcher's processes and machines. (Sections owned by the floors below are defined there:
``data.settings``, ``output.settings``, ``checkpoint.settings``, ``strategies.registry``.)

Each section is a frozen dataclass of flat ``TrainConfig`` fields, built by ``TrainConfig.section``,
with its own ``check``. No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.runtime.preempt import signal_number


@dataclass(frozen=True)
class OptimSettings:
    """How long to train, the batch, the optimizer, the learning rate and its schedule."""

    epochs: int = 20
    max_steps: Optional[int] = None
    batch_size: int = 64
    accumulate: int = 1
    lr: float = 0.01
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    lr_scaling: str = "none"
    base_batch_size: Optional[int] = None
    optimizer: str = "adam"
    betas: Optional[str] = None
    eps: Optional[float] = None
    weight_decay: float = 0.0
    decay_params: str = "ndim2"
    momentum: float = 0.9
    clip_grad: Optional[float] = None
    drop_last: bool = False
    seed: int = 0

    def check(self) -> None:
        for name in ("epochs", "batch_size", "accumulate"):
            _require(getattr(self, name) >= 1, name, "a positive integer")
        _require(self.max_steps is None or self.max_steps >= 1, "max_steps", "a positive integer")
        _require(self.lr > 0, "lr", "a positive number")
        _require(self.weight_decay >= 0, "weight_decay", "zero or positive")
        _require(self.momentum >= 0, "momentum", "zero or positive")
        _require(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "a positive number")
        _require(self.warmup_steps >= 0, "warmup_steps", "zero or positive")
        _require(self.base_batch_size is None or self.base_batch_size >= 1, "base_batch_size", "a positive integer")
        if self.lr_scaling != "none" and self.base_batch_size is None:
            raise UsageError(f"--lr-scaling {self.lr_scaling} scales --lr from the batch it was tuned for: "
                             "add --base-batch-size N")
        self._check_min_lr()
        self._check_adam_options()

    @property
    def peak_lr(self) -> float:
        """``--lr`` scaled from ``--base-batch-size`` to the global ``--batch-size`` (``--lr-scaling``).

        Linear scaling keeps the size of an epoch's total update when the batch grows (k times the
        batch, k times fewer steps, so k times the step); sqrt scaling keeps the gradient noise
        scale instead and is the usual choice for Adam-like optimizers at large batches.
        """
        if self.lr_scaling == "none" or self.base_batch_size is None:
            return self.lr
        ratio = self.batch_size / self.base_batch_size
        return self.lr * (ratio if self.lr_scaling == "linear" else math.sqrt(ratio))

    @property
    def adam_betas(self) -> Optional[tuple[float, float]]:
        """``--betas`` as two numbers (None: the optimizer's default); UsageError if malformed."""
        if self.betas is None:
            return None
        parts = self.betas.split(",")
        try:
            b1, b2 = (float(part) for part in parts)
        except ValueError:
            b1 = b2 = math.nan   # wrong count or not numbers: refused below, as out of range
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise UsageError(f"--betas {self.betas!r}: expected two numbers in [0, 1) separated by a comma, "
                             "e.g. --betas 0.9,0.95")
        return b1, b2

    def _check_min_lr(self) -> None:
        _require(self.min_lr >= 0, "min_lr", "zero or positive")
        if self.min_lr and self.lr_schedule == "constant":
            raise UsageError(f"--min-lr {self.min_lr:g} is the floor of a decaying schedule, and --lr-schedule "
                             "constant does not decay: add --lr-schedule cosine (or step), or leave out --min-lr")
        if self.min_lr >= self.peak_lr:
            raise UsageError(f"--min-lr {self.min_lr:g} must be below the peak learning rate {self.peak_lr:g} "
                             "(--lr, scaled by --lr-scaling): the schedule decays from the peak to it")

    def _check_adam_options(self) -> None:
        given = [name for name in ("betas", "eps") if getattr(self, name) is not None]
        if given and self.optimizer not in ("adam", "adamw"):
            flags = " and ".join(f"--{name}" for name in given)
            raise UsageError(f"{flags} {'are' if len(given) > 1 else 'is'} for --optimizer adam and adamw; "
                             f"--optimizer {self.optimizer} has no such setting: use --optimizer adamw (or adam), "
                             f"or leave out {flags}")
        self.adam_betas   # (raises for a malformed value)
        _require(self.eps is None or self.eps > 0, "eps", "a positive number, e.g. 1e-8")


@dataclass(frozen=True)
class EvalSettings:
    """When the trainer evaluates and on what: every ``eval_every`` steps besides each epoch's end,
    on a fixed sample of ``eval_batches`` batches (None: the whole test set), and with
    ``eval_train`` on a sample of the training set too (``scaleloop.loop.evaluations``)."""

    eval_every: Optional[int] = None
    eval_batches: Optional[int] = None
    eval_train: bool = False
    batch_size: int = 64
    seed: int = 0

    def check(self) -> None:
        if self.eval_every is not None and self.eval_every < 1:
            raise UsageError(f"--eval-every must be a positive number of optimizer steps, got {self.eval_every} "
                             "(leave it out to evaluate at epoch ends only)")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise UsageError(f"--eval-batches must be a positive number of batches, got {self.eval_batches} "
                             "(leave it out to evaluate the whole test set)")

    @property
    def sample_size(self) -> Optional[int]:
        """Samples an evaluation reads from each set (None: all of them)."""
        return None if self.eval_batches is None else self.eval_batches * self.batch_size


@dataclass(frozen=True)
class LaunchSettings:
    """How many processes on how many machines, where they meet, and how the launcher treats them."""

    nproc: int = 1
    nnodes: int = 1
    min_nnodes: int = 0
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: int = 29500
    rdzv_endpoint: Optional[str] = None
    rdzv_id: str = "scaleloop"
    rdzv_conf: Optional[str] = None
    local_addr: Optional[str] = None
    max_restarts: int = 0
    signal: str = "SIGUSR1"
    requeue: bool = False
    backend: Optional[str] = None
    timeout: float = 1800.0

    @property
    def elastic(self) -> bool:
        """Whether the job's machines may change while it runs (``--nnodes MIN:MAX``, MIN < MAX)."""
        return 0 < self.min_nnodes < self.nnodes

    def check(self) -> None:
        _require(self.nproc >= 1, "nproc", "a positive integer")
        _require(self.nnodes >= 1, "nnodes", "a positive integer")
        _require(0 <= self.min_nnodes <= self.nnodes, "min_nnodes", f"in 0..{self.nnodes} (--nnodes MIN:MAX)")
        _require(0 <= self.node_rank < self.nnodes, "node_rank", f"in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        _require(1 <= self.master_port <= 65535, "master_port", "a port number in 1..65535")
        _require(self.max_restarts >= 0, "max_restarts", "zero or positive")
        signal_number(self.signal)   # a name that is no catchable signal: one line now, not at the stop
        _require(self.timeout > 0, "timeout", "a positive number of seconds")
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            nnodes = f"{self.min_nnodes}:{self.nnodes}" if self.elastic else str(self.nnodes)
            raise UsageError(f"--nnodes {nnodes} needs where to meet: "
                             + ("--rdzv-endpoint HOST:PORT (an elastic job meets at a c10d rendezvous)" if self.elastic
                                else "--master-addr HOST (with --node-rank) or --rdzv-endpoint HOST:PORT"))
        if self.rdzv_endpoint and self.master_addr:
            raise UsageError("give either --master-addr (static) or --rdzv-endpoint (elastic), not both")
        if self.rdzv_endpoint:   # now, before the launcher makes the run directory
            split_endpoint(self.rdzv_endpoint)
            conf_pairs(self.rdzv_conf)
        if self.elastic and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes} lets machines leave and join, which needs the "
                             "c10d rendezvous: add --rdzv-endpoint HOST:PORT (instead of --master-addr)")


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise UsageError(f"--{name.replace('_', '-')} must be {what}")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as host and port; UsageError for anything else."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    return host, int(port)


def conf_pairs(user_conf: Optional[str]) -> list[str]:
    """``--rdzv-conf``'s ``KEY=VALUE`` pairs; UsageError for anything else (checked with the config)."""
    pairs = [p.strip() for p in (user_conf or "").split(",") if p.strip()]
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf {user_conf!r}: expected KEY=VALUE[,KEY=VALUE...], "
                             "e.g. last_call_timeout=5,join_timeout=600")
    return pairs
