"""The config's model-and-data section: what is trained on (and the model's sizes), and its checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scaleloop.errors import UsageError

# The built-in datasets and models, by name (here, without torch, for the launcher's checks).
DATASET_NAMES: tuple[str, ...] = ("digits", "random", "mnist", "images", "tokens", "tokenfile", "tokenfile-seq")
MODEL_NAMES: tuple[str, ...] = ("simplenet", "biggernet", "convnet", "tinygpt")


@dataclass(frozen=True)
class DataSettings:
    """The dataset and model names, generated data's sizes, the user's loss and metrics, loading."""

    model: str = "simplenet"
    data: str = "digits"
    data_dir: Optional[str] = None
    hidden_dim: int = 128
    n_samples: int = 10_000
    input_dim: int = 20
    image_size: int = 32
    seq_len: int = 64
    vocab_size: int = 256
    test_fraction: float = 0.2
    task: str = "auto"
    loss: Optional[str] = None
    metrics: Optional[str] = None
    num_workers: int = 0
    persistent_workers: bool = False

    def check(self) -> None:
        for name in ("hidden_dim", "n_samples", "input_dim", "image_size", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{_flag(name)} must be a positive integer")
        if not 0 <= self.test_fraction < 1:
            raise UsageError("--test-fraction must be in [0, 1)")
        if self.num_workers < 0:
            raise UsageError("--num-workers must be zero or positive")
        for name in ("loss", "metrics"):
            for spec in (getattr(self, name) or "").split(","):
                if getattr(self, name) is not None and ":" not in spec:
                    raise UsageError(f"{_flag(name)} {spec.strip()!r}: expected 'package.module:function'")
        if self.persistent_workers and self.num_workers == 0:
            raise UsageError("--persistent-workers keeps DataLoader worker processes between epochs, and "
                             "--num-workers is 0 (no workers): add --num-workers N, or drop it")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
