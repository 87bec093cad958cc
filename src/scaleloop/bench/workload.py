"""The training a benchmark measures, described once and built identically in every process.

A ``Workload`` is what stays the same across the runs being compared (model, data, seed,
optimizer, precision); a ``RunSpec`` is what each run changes (strategy, global batch,
threads). Both are plain values that travel to worker processes as JSON.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from scaleloop.config import TrainConfig


@dataclass(frozen=True)
class Workload:
    """Model, data and optimizer of a benchmark (sizes as in ``TrainConfig``)."""

    model: str = "biggernet"
    data: str = "images"
    hidden_dim: int = 1024
    image_size: int = 32
    input_dim: int = 20
    seq_len: int = 64
    vocab_size: int = 256
    n_samples: int = 4096
    optimizer: str = "adam"
    lr: float = 1e-3
    precision: str = "fp32"
    device: str = "cpu"
    seed: int = 0
    steps: int = 30          # timed optimizer steps per run
    warmup: int = 5          # untimed steps first (allocations, DDP bucket rebuild, caches)
    compile: bool = False    # torch.compile the model (train --compile); warm-up steps pay the compilation

    def to_config(self, **changes: Any) -> TrainConfig:
        """The ``TrainConfig`` of this workload (for the library's own builders and ``train``)."""
        cfg = TrainConfig(model=self.model, data=self.data, hidden_dim=self.hidden_dim,
                          image_size=self.image_size, input_dim=self.input_dim, seq_len=self.seq_len,
                          vocab_size=self.vocab_size, n_samples=self.n_samples, optimizer=self.optimizer,
                          lr=self.lr, precision=self.precision, device=self.device, seed=self.seed, compile=self.compile,
                          test_fraction=0.0, progress=False, tensorboard=False, checkpoints=False)
        return cfg.replace(**changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Workload":
        return cls(**values)

    def describe(self) -> str:
        """``biggernet (hidden 1024) on images 32x32, adam, fp32``."""
        what = self.model + (f" (hidden {self.hidden_dim})" if self.model in ("simplenet", "biggernet") else "")
        data = {"images": f"images {self.image_size}x{self.image_size}", "random": f"random ({self.input_dim} features)",
                "tokens": f"tokens (seq {self.seq_len}, vocab {self.vocab_size})"}.get(self.data, self.data)
        return f"{what} on {data}, {self.optimizer}, {self.precision}" + (", compiled" if self.compile else "")


@dataclass(frozen=True)
class RunSpec:
    """One measured run: a strategy at a global batch, with a thread count per process."""

    label: str
    strategy: str
    global_batch: int
    threads: Optional[int] = 1   # torch threads per process on CPU (None: leave torch's default)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunSpec":
        return cls(**values)


def build(workload: Workload, global_batch: int):  # -> (Datasets, nn.Module)
    """The workload's data and freshly initialised model, seeded as ``scaleloop train`` seeds them.

    The training set holds at least two global batches, so that every timed step is full.
    """
    from scaleloop.data.datasets import build_datasets
    from scaleloop.loop.build import seed_everything
    from scaleloop.models import build_model

    seed_everything(workload.seed)
    data = build_datasets(workload.data, n_samples=max(workload.n_samples, 2 * global_batch),
                          input_dim=workload.input_dim, image_size=workload.image_size,
                          seq_len=workload.seq_len, vocab_size=workload.vocab_size,
                          test_fraction=0.0, seed=workload.seed)
    model = build_model(workload.model, data.info, hidden_dim=workload.hidden_dim)
    return data, model


def grad_bytes(model: Any) -> int:
    """Bytes of all gradients of one step: what data parallelism all-reduces per optimizer step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
