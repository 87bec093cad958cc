"""Small in-process training runs shared by the loop's tests (test_training, test_evaluation)."""
from __future__ import annotations

from pathlib import Path

from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv

CPU = DistEnv()


def quiet(_msg: str) -> None:
    pass


def small(tmp_path: Path, name: str = "run", **changes) -> TrainConfig:
    """256 random samples, batch 64 (4 steps per epoch), 2 epochs, a log row every 2 steps."""
    base = dict(data="random", n_samples=256, epochs=2, batch_size=64, out=str(tmp_path / name),
                progress=False, tensorboard=False, device="cpu", log_every=2)
    base.update(changes)
    return TrainConfig(**base).validate()
