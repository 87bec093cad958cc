"""The training step (scaleloop.loop.step): one function, the same weights as a hand-written step,
and observers that watch without changing anything."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.data.batch import call_model
from scaleloop.loop.build import build_run
from scaleloop.loop.step import Observer, steps_of, train_step
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import Strategy

CPU = DistEnv()


def small(tmp_path: Path, **changes) -> TrainConfig:
    base = dict(data="random", n_samples=200, epochs=1, batch_size=64, out=str(tmp_path / "run"),
                progress=False, tensorboard=False, device="cpu", lr_schedule="cosine", warmup_steps=2)
    base.update(changes)
    return TrainConfig(**base).validate()


class Events(Observer):
    """Records the order of the step's events."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def micro_batch(self, batch) -> None:
        self.seen.append("micro_batch")

    def forward_done(self, loss) -> None:
        self.seen.append("forward_done")

    def micro_done(self, batch, loss) -> None:
        self.seen.append("micro_done")

    def synced(self) -> None:
        self.seen.append("synced")

    def stepped(self) -> None:
        self.seen.append("stepped")


def by_train_step(cfg: TrainConfig, watch: Observer) -> tuple[list[float], list[float], dict]:
    """One epoch through ``train_step``: the micro-batches' losses, the learning rates, the weights."""
    run = build_run(cfg, CPU)
    run.model.train()
    run.loader.set_epoch(0)
    losses, lrs = [], []
    for micro_batches in steps_of(run.loader):
        lrs.append(run.optimizer.param_groups[0]["lr"])
        losses += [float(loss) for loss in train_step(run, micro_batches, watch)[0]]
    return losses, lrs, {k: v.clone() for k, v in run.model.state_dict().items()}


def by_hand(cfg: TrainConfig) -> tuple[list[float], list[float], dict]:
    """The same epoch as a learner writes it: loss, weighted backward, clip, step, zero, schedule."""
    run = build_run(cfg, CPU)
    model, optimizer = run.model, run.optimizer
    model.train()
    run.loader.set_epoch(0)
    losses, lrs = [], []
    for batch in run.loader:
        x, y = batch
        loss = run.loss_fn(call_model(model, x), y)
        scale = batch.place.loss_scale   # the micro-batch's share of the global step
        (loss * scale if scale != 1.0 else loss).backward()
        losses.append(float(loss.detach()))
        if batch.last_micro:
            lrs.append(optimizer.param_groups[0]["lr"])
            if cfg.optim.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()
    return losses, lrs, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("changes", [{}, {"accumulate": 2}, {"clip_grad": 0.01},
                                     {"n_samples": 197, "batch_size": 66, "accumulate": 3}])
def test_the_step_is_the_hand_written_step_bit_for_bit(tmp_path: Path, changes: dict) -> None:
    cfg = small(tmp_path, **changes)
    losses, lrs, weights = by_train_step(cfg, Observer())
    losses_ref, lrs_ref, weights_ref = by_hand(cfg)
    assert losses == losses_ref and lrs == lrs_ref
    assert weights.keys() == weights_ref.keys()
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)


def test_an_observer_sees_each_point_in_order_and_changes_nothing(tmp_path: Path) -> None:
    cfg = small(tmp_path, accumulate=2)
    events = Events()
    losses, lrs, weights = by_train_step(cfg, events)
    losses_ref, lrs_ref, weights_ref = by_train_step(cfg, Observer())
    assert losses == losses_ref and lrs == lrs_ref
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)
    per_step = ["micro_batch", "forward_done", "micro_done"] * 2 + ["synced", "stepped"]
    assert len(events.seen) % len(per_step) == 0 and events.seen
    assert events.seen == per_step * (len(events.seen) // len(per_step))


def test_a_step_not_committed_is_taken_again_and_the_optimizer_and_schedule_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between replica groups a step during which a group failed is not committed (``commit`` is
    False): the same micro-batches again from the same weights, nothing of the first try kept."""
    cfg = small(tmp_path, accumulate=2)
    answers = iter([True, False, False])   # the second step is committed on its third try
    monkeypatch.setattr(Strategy, "commit", lambda self: next(answers, True))
    events = Events()
    losses, lrs, weights = by_train_step(cfg, events)
    losses_ref, lrs_ref, weights_ref = by_hand(cfg)
    assert losses == losses_ref and lrs == lrs_ref
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)
    tried = ["micro_batch", "forward_done", "micro_done"] * 2 + ["synced"]
    assert events.seen[:len(tried) * 4 + 2] == tried + ["stepped"] + tried * 3 + ["stepped"]


def test_steps_of_groups_the_micro_batches_of_each_step(tmp_path: Path) -> None:
    run = build_run(small(tmp_path, accumulate=3, n_samples=197, batch_size=66), CPU)
    run.loader.set_epoch(0)
    groups = list(steps_of(run.loader))
    assert [len(g) for g in groups] == [3] * len(groups) and len(groups) == run.loader.sampler.steps_per_epoch
    for g in groups:
        assert [b.last_micro for b in g] == [False, False, True]
        assert len({b.step for b in g}) == 1


@pytest.mark.parametrize("clip", [None, 0.01])
def test_the_norm_a_log_row_shows_is_clip_grad_norm_s_bit_for_bit(tmp_path: Path, clip: float | None) -> None:
    """``train_step(..., norm=True)`` returns the whole gradient's norm before clipping: the number
    ``torch.nn.utils.clip_grad_norm_`` returns for the same gradients. With clipping, it is the norm
    the clipping used (the weights stay the hand-written step's)."""
    cfg = small(tmp_path, clip_grad=clip)
    run, ref = build_run(cfg, CPU), build_run(cfg, CPU)
    for r in (run, ref):
        r.model.train()
        r.loader.set_epoch(0)
    norms, expected = [], []
    for micro_batches, (x, y) in zip(steps_of(run.loader), ref.loader):   # one micro-batch per step
        norms.append(train_step(run, micro_batches, Observer(), norm=True)[1])
        ref.loss_fn(call_model(ref.model, x), y).backward()
        # max_norm inf: clip_grad_norm_ scales by 1.0, which changes no bit, and returns the norm.
        expected.append(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), clip if clip is not None else math.inf))
        ref.optimizer.step()
        ref.optimizer.zero_grad(set_to_none=True)
        ref.scheduler.step()
    assert len(norms) > 1 and all(torch.equal(a, b) for a, b in zip(norms, expected))
    weights, weights_ref = run.model.state_dict(), ref.model.state_dict()
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)
