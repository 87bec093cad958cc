"""The training step's plain path (scaleloop.loop.step): one process in fp32 takes the strategy's
calls written out, and must give the very weights, losses and learning rates the strategy's own
calls give; every other case keeps those calls."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.loop.build import build_run
from scaleloop.loop.step import Observer, Step
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import HandWrittenLoop
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.single import SingleDevice

CPU = DistEnv()


def small(tmp_path: Path, **changes) -> TrainConfig:
    base = dict(data="random", n_samples=200, epochs=1, batch_size=64, out=str(tmp_path / "run"),
                progress=False, tensorboard=False, device="cpu", lr_schedule="cosine", warmup_steps=2)
    base.update(changes)
    return TrainConfig(**base).validate()


def steps(cfg: TrainConfig, observer: Optional[Observer]) -> tuple[Step, list[float], list[float], dict]:
    """Every micro-batch and step of one epoch: the losses, the learning rates, the final weights."""
    run = build_run(cfg, CPU)
    step = Step(run, observer)
    losses, lrs = [], []
    run.model.train()
    run.loader.set_epoch(0)
    for batch in run.loader:
        losses.append(float(step.micro(batch)))
        if batch.last_micro:
            lrs.append(step.update())
    return step, losses, lrs, {k: v.clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("changes", [{}, {"accumulate": 2}, {"clip_grad": 0.01}, {"n_samples": 197, "batch_size": 66, "accumulate": 3}])
def test_plain_path_gives_the_strategy_calls_weights_bit_for_bit(tmp_path: Path, changes: dict) -> None:
    cfg = small(tmp_path, **changes)
    plain, losses, lrs, weights = steps(cfg, None)
    general, losses_ref, lrs_ref, weights_ref = steps(cfg, Observer())   # an observer keeps the calls
    assert plain.micro.__func__ is Step._plain_micro and general.micro.__func__ is Step.micro
    assert losses == losses_ref and lrs == lrs_ref
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)
    assert plain.gradient_bytes == general.gradient_bytes and plain.gradient_bytes
    assert plain.take_own_s() == 0.0   # one rank: no one to compare its own time with


def test_plain_step_only_where_nothing_surrounds_the_calls() -> None:
    assert SingleDevice(CPU).plain_step()
    assert not SingleDevice(CPU, Precision("bf16", CPU.device)).plain_step()
    assert not SingleDevice(CPU, Precision("fp16", CPU.device)).plain_step()

    class NoSync(HandWrittenLoop):   # as DDP's accumulate: a context around the micro-step
        def accumulate(self, model, batch):
            return contextlib.nullcontext()

    class Synced(HandWrittenLoop):   # as a manual all-reduce after the backward
        def _sync_gradients(self) -> None:
            pass

    assert not NoSync(CPU).plain_step() and not Synced(CPU).plain_step()
